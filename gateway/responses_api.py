"""OpenAI's Responses API, a thin translator onto the chat completions' path:

    POST   /responses              create (stream: typed SSE events; background: reply at once, generate on)
    GET    /responses/{id}         a stored response, as it stands
    DELETE /responses/{id}         forget it (and stop it, if it is still generating)
    POST   /responses/{id}/cancel  stop a response that is still generating

A request becomes a chat request (instructions as a system message, the stored conversation of its
previous_response_id, its input items as messages; function tools, tool_choice and text.format in chat's terms)
and is planned and run as a chat completion is (openai_choices.plan_chat, Engine.generate); the reply leaves as a
response object or its events (responses_format.py), and with store it is kept (responses_store.py).

The blueprint is registered under the OpenAI API's prefixes, its names starting with "openai": errors come in
OpenAI's envelope and metrics count its requests under "openai".
"""

from __future__ import annotations

import contextvars
import json
import re
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

from flask import Blueprint, current_app, jsonify

from gateway import held_sessions
from gateway import responses_format as wire
from gateway.access import client_id
from gateway.current_engine import get_engine
from gateway.errors import APIError, BadRequest, from_exception
from gateway.json_bodies import json_body
from gateway.openai_choices import plan_chat
from gateway.openai_format import error_body
from gateway.prompts import parse_tool_calls
from gateway.responses_store import ResponseStore, StoredResponse
from gateway.schemas import ChatCompletionRequest, parse
from gateway.schemas.responses import ResponseCreateRequest, ResponsesNamedToolChoice, ResponsesTextConfig
from gateway.sse import event_stream

blueprint = Blueprint("openai_responses", __name__)
CANCEL_WAIT_SECONDS = 10.0  # how long a cancel waits for the generation to stop at its next token
# the chat request's fields that an error may name, as this API calls them
CHAT_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


@blueprint.record_once
def _install_store(state) -> None:
    limits = state.app.extensions["engine"].limits
    state.app.extensions["responses_store"] = ResponseStore(limits.max_stored_responses,
                                                            limits.stored_response_idle_timeout)


def stored_responses() -> ResponseStore:
    return current_app.extensions["responses_store"]


# ------------------------------------------------------------------------------------------ routes


@blueprint.post("/responses")
def create_response():
    fields = json_body(ResponseCreateRequest)
    store = stored_responses()
    if fields.background and fields.store is False:
        raise BadRequest("background: needs store (a background response is read back by its id)", field="background")
    history = previous_conversation(store, fields.previous_response_id)
    engine = get_engine()
    with in_responses_terms():
        chat, input_messages = chat_request(fields, history)
        model, tools, prompt_ids, plan = plan_chat(engine, chat)
    run = ResponseRun(wire.response_object(wire.new_id("resp"), model.name, fields), tools, len(prompt_ids), plan,
                      engine.stats.begin())
    if fields.store is not False:
        run.keep_in(store, StoredResponse(run.body["id"], client_id(), run.body), history + input_messages)
    if fields.stream:
        return event_stream(run.events, error_body, named=True)
    if fields.background:
        release = held_sessions.hand_over()  # the session is the generation's now, not the request's

        def run_in_background():
            try:
                run.run_to_end()
            finally:
                release()

        context = contextvars.copy_context()  # the request's id stays on the generation's log lines
        threading.Thread(target=context.run, args=(run_in_background,), name="background-response",
                         daemon=True).start()
        return jsonify(run.body)
    return jsonify(run.complete())


@blueprint.get("/responses/<response_id>")
def get_response(response_id: str):
    return jsonify(stored_responses().get(response_id, client_id()).body)


@blueprint.delete("/responses/<response_id>")
def delete_response(response_id: str):
    stored_responses().remove(response_id, client_id())
    return jsonify(wire.deleted(response_id))


@blueprint.post("/responses/<response_id>/cancel")
def cancel_response(response_id: str):
    record = stored_responses().get(response_id, client_id())
    if record.finished.is_set() and record.body["status"] != "cancelled":
        raise BadRequest(f"response_id: response {response_id} is no longer generating "
                         f"(status {record.body['status']}); only one in progress can be cancelled",
                         field="response_id")
    record.cancel.set()
    record.finished.wait(CANCEL_WAIT_SECONDS)  # the generation stops at its next token
    return jsonify(record.body)


def previous_conversation(store: ResponseStore, response_id: Optional[str]) -> list[dict]:
    """The chat messages of a stored response's conversation, up to its reply ([] for none)."""
    if response_id is None:
        return []
    try:
        record = store.get(response_id, client_id())
    except APIError as error:
        error.field = "previous_response_id"
        raise
    if not record.finished.is_set():
        raise BadRequest(f"previous_response_id: response {response_id} is still generating",
                         field="previous_response_id")
    return record.conversation


# ------------------------------------------------------------------------------------------ into chat's terms


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


# ------------------------------------------------------------------------------------------ one response


class ResponseRun:
    """One response generated: its events as they come (streamed, or run through whole), its stored record (if
    any) kept current. With tools offered, the reply is a call or a text, known only at its end: held whole."""

    def __init__(self, body: dict, tools, prompt_tokens: int, plan: tuple, stats):
        self.body, self.tools, self.prompt_tokens, self.stats = body, tools, prompt_tokens, stats
        self.choices, self.make_request = plan
        self.event = wire.EventCounter()
        self.message_id = wire.new_id("msg")
        self.started = False  # the message item's first events have gone out
        self.output_tokens = 0
        self.failure: Optional[APIError] = None
        self.cancel = threading.Event()
        self.store, self.record, self.conversation = None, None, []

    def keep_in(self, store: ResponseStore, record: StoredResponse, conversation: list[dict]) -> None:
        """Store the response; `conversation` (chat messages up to this input) continues with its reply."""
        self.store, self.record, self.conversation, self.cancel = store, record, conversation, record.cancel
        store.add(record)

    def complete(self) -> dict:
        """The finished response; an error is the request's (an OpenAI error reply), as on chat completions."""
        self.run_to_end()
        if self.failure is not None:
            raise self.failure
        return self.body

    def run_to_end(self) -> None:
        for _ in self.events(lambda: False):
            pass

    def events(self, gone) -> Iterator[dict]:
        """Every event of the response, in order; `gone()` (the client left) or a cancel stops the generation."""
        try:
            yield self.event("response.created", response=self.body)
            yield self.event("response.in_progress", response=self.body)
            text, finish_reason = yield from self.generated(lambda: gone() or self.cancel.is_set())
            yield from self.finished(text, finish_reason)
        except Exception as error:  # once the response has begun, an error is its last event, never a traceback
            self.failure = from_exception(error)
            self.update(status="failed", error=wire.failure(self.failure), usage=self.usage())
            yield self.event("response.failed", response=self.body)
        finally:
            if self.record is not None:
                self.store.finish(self.record)

    def generated(self, cancelled) -> Iterator[dict]:
        """The text events as the deltas come (unless the reply is held whole); returns (text, finish_reason)."""
        text, finish_reason = "", "stop"
        for _, delta in self.choices.run(self.make_request, cancelled, self.stats):
            text += delta.text
            self.output_tokens += delta.token_count
            finish_reason = delta.finish_reason or finish_reason
            if self.tools is None:
                yield from self.text_events(delta.text)
        return text, finish_reason

    def text_events(self, text: str) -> Iterator[dict]:
        if not self.started:
            self.started = True
            yield from wire.message_start(self.event, 0, self.message_id)
        if text:
            yield wire.text_delta(self.event, 0, self.message_id, text)

    def finished(self, text: str, finish_reason: str) -> Iterator[dict]:
        """The output items' last events, then the response's: completed, or incomplete (cut short, cancelled)."""
        calls = parse_tool_calls(text, self.tools) if self.tools else None
        if calls:
            items = [wire.function_call_item(name, arguments) for name, arguments in calls]
            for index, item in enumerate(items):
                yield from wire.function_call_events(self.event, index, item)
        else:
            items = [wire.message_item(self.message_id, "completed" if finish_reason == "stop" else "incomplete", text)]
            yield from self.text_events(text if self.tools is not None else "")
            yield from wire.message_end(self.event, 0, items[0])
        status = {"stop": "completed", "length": "incomplete", "cancelled": "cancelled"}[finish_reason]
        self.conversation = self.conversation + [reply_message(text, items if calls else None)]
        self.update(status=status, output=items, usage=self.usage(), completed_at=wire.now(),
                    incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None)
        yield self.event(wire.FINAL_EVENTS[status], response=self.body)

    def usage(self) -> dict:
        return wire.usage(self.prompt_tokens, self.output_tokens)

    def update(self, **changes) -> None:
        """A new body (readers of the stored one see either the old or the new, whole)."""
        self.body = {**self.body, **changes}
        if self.record is not None:
            self.record.body, self.record.conversation = self.body, self.conversation


def reply_message(text: str, calls: Optional[list[dict]]) -> dict:
    """The reply as the chat message that a follow-up's conversation holds."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call["call_id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
        for call in calls]}
