"""A request's lengths against the gateway's Limits and the model's context: each a 400 naming the field.

    check_new_tokens()      a request's token budget against MAX_NEW_TOKENS
    check_max_length()      a session's length against the model's max_session_length
    check_context_length()  a prompt (and the completion asked for) against the model's context
    nesting_depth()         how deep a request's JSON nests (the code that walks it recursively has a bound)
"""

from __future__ import annotations

from config import ModelConfig
from gateway.errors import BadRequest, LengthExceeded


def check_new_tokens(field: str, value: int | None, cap: int) -> None:
    if value is not None and value > cap:
        raise BadRequest(f"{field}: at most {cap}, got {value} (MAX_NEW_TOKENS)", field=field)


def check_max_length(model: ModelConfig, max_length: int | None) -> None:
    if max_length is not None and max_length > model.max_session_length:
        raise BadRequest(f"max_length: at most {model.max_session_length} for {model.name}, got {max_length}",
                         field="max_length")


def check_context_length(model: ModelConfig, prompt_tokens: int, new_tokens: int, field: str) -> None:
    """The prompt and the tokens asked for must fit the model's context; `field` is where the prompt came in."""
    limit, total = model.max_session_length, prompt_tokens + new_tokens
    if total > limit:
        asked = f" ({prompt_tokens} in the {field}, {new_tokens} in the completion)" if new_tokens else ""
        raise LengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, you requested {total} tokens{asked}. "
            f"Please reduce the length of the {field}" + (" or of the completion." if new_tokens else "."),
            field=field)


def nesting_depth(value) -> int:
    """How deep JSON-like `value` nests (a scalar: 0, [] or {}: 1), measured level by level, without recursion."""
    depth, level = 0, [value]
    while level := [item for item in level if isinstance(item, (dict, list))]:
        depth += 1
        level = [child for item in level for child in (item.values() if isinstance(item, dict) else item)]
    return depth
