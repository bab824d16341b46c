"""OpenAI's Responses API wire format, as functions of their arguments: the response object, its output items (a
message of output_text, function calls), usage, and the typed stream events, numbered in order.

A streamed reply is, in order (each event with its sequence_number, from 0):

    response.created, response.in_progress
    reasoning:        response.output_item.added, response.content_part.added, response.reasoning_text.delta ...,
    (a thinking model) response.reasoning_text.done, response.content_part.done, response.output_item.done
    a message:        response.output_item.added, response.content_part.added, response.output_text.delta ...,
                      response.output_text.done, response.content_part.done, response.output_item.done
    then each call:   response.output_item.added, response.function_call_arguments.delta ...,
                      response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete: cut at max_output_tokens, or cancelled; response.failed)
"""

from __future__ import annotations

import time
import uuid
from typing import Optional

from gateway.errors import APIError
from gateway.openai.responses.schemas import ResponseCreateRequest

FINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                "cancelled": "response.incomplete", "failed": "response.failed"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def response_object(response_id: str, model: str, fields: ResponseCreateRequest) -> dict:
    """A response in progress, without output yet, that echoes the settings it was asked for."""
    text_format = fields.text.format if fields.text and fields.text.format else None
    return {
        "id": response_id, "object": "response", "created_at": now(), "status": "in_progress",
        "completed_at": None, "model": model, "output": [], "usage": None, "error": None,
        "incomplete_details": None, "instructions": fields.instructions,
        "previous_response_id": fields.previous_response_id, "max_output_tokens": fields.max_output_tokens,
        "temperature": fields.temperature, "top_p": fields.top_p,
        "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                 else {"type": "text"}},
        "reasoning": {"effort": fields.reasoning.effort if fields.reasoning else None,
                      "summary": fields.reasoning.summary if fields.reasoning else None},
        "tools": [tool.model_dump(exclude_none=True) for tool in fields.tools or []],
        "tool_choice": _dumped(fields.tool_choice) or "auto",
        "parallel_tool_calls": fields.parallel_tool_calls is not False, "store": fields.store is not False,
        "background": bool(fields.background), "metadata": fields.metadata or {}, "user": fields.user,
        "truncation": "disabled",
    }


def _dumped(value):
    return value.model_dump(exclude_none=True) if hasattr(value, "model_dump") else value


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, status: str, text: Optional[str] = None) -> dict:
    """The assistant's message; without `text`, one just begun (no content part yet)."""
    content = [] if text is None else [output_text(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, status: str, text: Optional[str] = None) -> dict:
    """A thinking model's reasoning, whole as content (no summary is made); without `text`, one just begun."""
    content = [] if text is None else [reasoning_text(text)]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def function_call_item(name: str, status: str = "in_progress", arguments: str = "") -> dict:
    """A function call; by default one just begun (its arguments come in deltas)."""
    return {"id": new_id("fc"), "type": "function_call", "status": status, "call_id": new_id("call"), "name": name,
            "arguments": arguments}


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict:
    """`cached_tokens`: of the input, held by the servers already (a previous_response_id's conversation);
    `reasoning_tokens`: of the output, a thinking model's reasoning."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def failure(error: APIError) -> dict:
    """A failed response's `error` (OpenAI's codes: a client's mistake is an invalid prompt)."""
    code = "rate_limit_exceeded" if error.status == 429 else "invalid_prompt" if error.status < 500 else "server_error"
    return {"code": code, "message": error.message}


def deleted(response_id: str) -> dict:
    return {"id": response_id, "object": "response.deleted", "deleted": True}


class EventCounter:
    """Makes a stream's events, numbered in the order they are made (sequence_number, from 0)."""

    def __init__(self):
        self.count = 0

    def __call__(self, kind: str, **fields) -> dict:
        event = {"type": kind, **fields, "sequence_number": self.count}
        self.count += 1
        return event


def message_start(event: EventCounter, index: int, item_id: str) -> list[dict]:
    return [event("response.output_item.added", output_index=index, item=message_item(item_id, "in_progress")),
            event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                  part=output_text(""))]


def text_delta(event: EventCounter, index: int, item_id: str, text: str) -> dict:
    return event("response.output_text.delta", item_id=item_id, output_index=index, content_index=0, delta=text,
                 logprobs=[])


def message_end(event: EventCounter, index: int, item: dict) -> list[dict]:
    """The events that close a message item, `item` being the whole message."""
    text = item["content"][0]["text"]
    return [event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text,
                  logprobs=[]),
            event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                  part=output_text(text)),
            event("response.output_item.done", output_index=index, item=item)]


def reasoning_start(event: EventCounter, index: int, item_id: str) -> list[dict]:
    return [event("response.output_item.added", output_index=index, item=reasoning_item(item_id, "in_progress")),
            event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                  part=reasoning_text(""))]


def reasoning_delta(event: EventCounter, index: int, item_id: str, text: str) -> dict:
    return event("response.reasoning_text.delta", item_id=item_id, output_index=index, content_index=0, delta=text)


def reasoning_end(event: EventCounter, index: int, item: dict) -> list[dict]:
    """The events that close a reasoning item, `item` being the whole of it."""
    text = item["content"][0]["text"]
    return [event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                  text=text),
            event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                  part=reasoning_text(text)),
            event("response.output_item.done", output_index=index, item=item)]


def call_start(event: EventCounter, index: int, item: dict) -> dict:
    return event("response.output_item.added", output_index=index, item=dict(item))


def call_arguments_delta(event: EventCounter, index: int, item_id: str, fragment: str) -> dict:
    return event("response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=fragment)


def call_end(event: EventCounter, index: int, item: dict) -> list[dict]:
    """The events that close a function call, `item` being the whole of it."""
    return [event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                  name=item["name"], arguments=item["arguments"]),
            event("response.output_item.done", output_index=index, item=item)]
