"""Chat messages into a prompt with the model's own chat template.

A template that knows tools (it mentions them) gets them as transformers passes them; any other template
gets a system message that lists the functions and the JSON a call must be, so that small models can call
tools too (and with tool_choice "required" or a named function, constrained decoding holds them to it).
"""

from __future__ import annotations

import json
from typing import Optional

from gateway.errors import BadRequest
from gateway.chat.schemas import ChatMessage, Tool

TOOLS_INSTRUCTION = (
    "You can call these functions:\n{functions}\n"
    'To call a function, reply with only a JSON object {{"name": <function name>, "arguments": <object>}} '
    "(or a JSON list of such objects for several calls), and nothing else."
)


def message_text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise BadRequest(f"messages[{index}].content: only text parts are supported, got {part.type!r}",
                             field=f"messages[{index}].content")
        texts.append(part.text)
    return "\n".join(texts)


def render_chat(tokenizer, messages: list[ChatMessage], tools: Optional[list[Tool]], continue_final: bool = False,
                as_prefix: bool = False, template_kwargs: Optional[dict] = None) -> str:
    """The prompt text for these messages, ending where the assistant's reply begins; with `continue_final`, where
    the last (assistant) message ends, so that the reply goes on from it (Anthropic's prefilled replies); with
    `as_prefix`, where the last message ends, as the beginning of a longer chat (a saved state).
    `template_kwargs`: more variables for the template (enable_thinking: reasoning.template_kwargs)."""
    template = tokenizer.chat_template or ""
    if not template:
        raise BadRequest("this model has no chat template: use /v1/completions", field="messages")
    template_knows_tools = "tools" in template
    rendered = []
    for index, message in enumerate(messages):
        entry = {"role": "system" if message.role == "developer" else message.role,
                 "content": message_text(message, index)}
        if message.name:
            entry["name"] = message.name
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            calls = [{"name": call.function.name, "arguments": _arguments(call.function.arguments, index)}
                     for call in message.tool_calls]
            if "tool_calls" in template:
                entry["tool_calls"] = [{"type": "function", "function": call} for call in calls]
            else:  # the model sees its earlier calls as the JSON it was asked to write
                entry["content"] = (entry["content"] + "\n" if entry["content"] else "") + json.dumps(
                    calls[0] if len(calls) == 1 else calls)
        rendered.append(entry)

    tool_dicts = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
    if tool_dicts and not template_knows_tools:
        rendered = _with_tools_instruction(rendered, tool_dicts)
    try:
        return tokenizer.apply_chat_template(rendered, tools=tool_dicts if template_knows_tools else None,
                                             add_generation_prompt=not (continue_final or as_prefix),
                                             continue_final_message=continue_final, tokenize=False,
                                             **_extra_variables(template_kwargs))
    except Exception as error:  # the template itself refused these messages (e.g. roles out of order)
        raise BadRequest(f"messages: the model's chat template refused them: {error}", field="messages") from None


# what render_chat sets itself: a request's chat_template_kwargs cannot override them
RENDER_ARGUMENTS = frozenset({"conversation", "messages", "tools", "add_generation_prompt", "continue_final_message",
                              "tokenize", "return_dict", "return_tensors", "chat_template", "documents", "padding",
                              "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask",
                              "sanitize_control_tokens"})


def _extra_variables(template_kwargs: Optional[dict]) -> dict:
    return {name: value for name, value in (template_kwargs or {}).items() if name not in RENDER_ARGUMENTS}


def _arguments(arguments: str, index: int):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        raise BadRequest(f"messages[{index}].tool_calls: arguments must be a JSON string",
                         field=f"messages[{index}].tool_calls") from None


def _with_tools_instruction(messages: list[dict], tools: list[dict]) -> list[dict]:
    functions = "\n".join(json.dumps(tool["function"]) for tool in tools)
    instruction = TOOLS_INSTRUCTION.format(functions=functions)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": messages[0]["content"] + "\n\n" + instruction}
        return [first, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]
