"""A Responses request in chat's terms: it runs as a chat completion does (openai/translate.py plan_chat).

Instructions become a system message, the stored conversation of its previous_response_id comes next, then its input
items as messages; function tools, tool_choice and text.format become chat's tools, tool_choice and response_format.
Errors from planning name this API's fields (input, max_output_tokens, text.format), not chat's.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from typing import Optional

from gateway.errors import APIError, BadRequest
from gateway.openai.responses.schemas import ResponseCreateRequest, ResponsesNamedToolChoice, ResponsesTextConfig
from gateway.openai.schemas import ChatCompletionRequest
from gateway.web.bodies import parse

# the chat request's fields that an error may name, as this API calls them
CHAT_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def chat_request(fields: ResponseCreateRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request this response runs as, and the messages its input adds to the conversation (instructions
    are not part of it: OpenAI does not carry them on to a follow-up)."""
    messages = input_messages(fields.input)
    system = [{"role": "system", "content": fields.instructions}] if fields.instructions else []
    body = {
        "model": fields.model, "messages": system + history + messages,
        "temperature": fields.temperature, "top_p": fields.top_p, "top_k": fields.top_k, "seed": fields.seed,
        "max_completion_tokens": fields.max_output_tokens, "response_format": response_format(fields.text),
        "tools": [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                  for tool in fields.tools] if fields.tools else None,
        "tool_choice": {"type": "function", "function": {"name": fields.tool_choice.name}}
        if isinstance(fields.tool_choice, ResponsesNamedToolChoice) else fields.tool_choice,
        "parallel_tool_calls": fields.parallel_tool_calls,
        "reasoning_effort": fields.reasoning.effort if fields.reasoning else None,
    }
    return parse(ChatCompletionRequest, {name: value for name, value in body.items() if value is not None}), messages


def input_messages(items) -> list[dict]:
    """The input as chat messages: a text is a user message; consecutive function calls are one assistant turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for index, item in enumerate(items):
        if item.type == "message":
            messages.append({"role": item.role, "content": _text(item.content)})
        elif item.type == "reasoning":
            continue  # an earlier reply's reasoning: thinking templates leave it out of the prompt
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": _arguments(item.arguments, index)}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return messages


def _text(content) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def _arguments(arguments: str, index: int) -> str:
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise BadRequest(f"input.{index}.arguments: must be a JSON object, as text", field=f"input.{index}.arguments")
    return arguments


def response_format(text: Optional[ResponsesTextConfig]) -> Optional[dict]:
    """text.format as chat's response_format (None for plain text)."""
    text_format = text.format if text else None
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.schema_ is None:
        raise BadRequest("text.format.schema: required for type json_schema", field="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": text_format.name or "response",
                                                   "schema": text_format.schema_, "strict": text_format.strict}}


@contextmanager
def in_responses_terms():
    """Errors from planning the chat request, naming this API's fields rather than chat's."""
    try:
        yield
    except APIError as error:
        chat_field = (error.field or "").split(".")[0]
        if chat_field in CHAT_FIELDS:
            error.field = CHAT_FIELDS[chat_field] + error.field[len(chat_field):]
            error.message = re.sub(rf"\b{chat_field}\b", CHAT_FIELDS[chat_field], error.message)
        raise
