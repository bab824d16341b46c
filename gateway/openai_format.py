"""OpenAI's wire format, as pure functions: completions, chunks, logprobs, usage, errors.

Two shapes of everything: chat (`chat.completion`, `chat.completion.chunk`, logprobs as `{content: [...]}`)
and text (`text_completion`, logprobs as parallel lists `tokens / token_logprobs / top_logprobs / text_offset`).
"""

from __future__ import annotations

import time
import uuid
from typing import Iterable, Optional, Sequence

from gateway.engine import TokenLogprob
from gateway.errors import APIError

FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop", "tool_calls": "tool_calls"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(tokenizer, logprobs: Iterable[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(item.token_id, item.logprob), "top_logprobs": [entry(token, value) for token, value in item.top]}
            for item in logprobs
        ]
    }


def completion_logprobs(tokenizer, logprobs: Sequence[Optional[TokenLogprob]], token_ids: Sequence[int],
                        text_offset: int = 0) -> dict:
    """The text-completion shape; an entry of None (the first echoed prompt token) has no logprob."""
    tokens, offsets, offset = [], [], text_offset
    for token_id in token_ids:
        tokens.append(token_text(tokenizer, token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [item.logprob if item else None for item in logprobs],
        "top_logprobs": [
            {token_text(tokenizer, token): value for token, value in item.top} if item else None for item in logprobs
        ],
        "text_offset": offsets,
    }


def usage(prompt_tokens: int, completion_tokens: int, timing: Optional[dict] = None) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        **(timing or {}),
    }


def chat_completion(request_id: str, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": now(), "model": model,
            "choices": choices, "usage": usage_}


def chat_choice(index: int, content: Optional[str], finish_reason: str, logprobs: Optional[dict] = None,
                tool_calls: Optional[list[dict]] = None) -> dict:
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": FINISH_REASONS[finish_reason]}


def chat_chunk(request_id: str, model: str, index: int, delta: dict, finish_reason: Optional[str] = None,
               logprobs: Optional[dict] = None, with_usage_field: bool = False) -> dict:
    chunk = {
        "id": request_id, "object": "chat.completion.chunk", "created": now(), "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                     "finish_reason": FINISH_REASONS[finish_reason] if finish_reason else None}],
    }
    if with_usage_field:
        chunk["usage"] = None  # OpenAI sets it on every chunk when include_usage is on; only the last has it
    return chunk


def usage_chunk(request_id: str, model: str, object_: str, usage_: dict) -> dict:
    return {"id": request_id, "object": object_, "created": now(), "model": model, "choices": [], "usage": usage_}


def text_completion(request_id: str, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": now(), "model": model,
            "choices": choices, "usage": usage_}


def text_choice(index: int, text: str, finish_reason: Optional[str], logprobs: Optional[dict] = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": FINISH_REASONS[finish_reason] if finish_reason else None}


def text_chunk(request_id: str, model: str, choice: dict, with_usage_field: bool = False) -> dict:
    chunk = {"id": request_id, "object": "text_completion", "created": now(), "model": model, "choices": [choice]}
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error",
               503: "service_unavailable"}  # any other 4xx is an invalid_request_error, any other 5xx a server_error


def error_body(error: APIError) -> dict:
    code = error.code
    if error.status == 404 and error.field == "model":
        code = "model_not_found"
    kind = ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "server_error")
    return {"error": {"message": error.message, "type": kind, "param": error.field, "code": code}}
