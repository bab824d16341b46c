"""OpenAI's Responses API, a thin translator onto the chat completions' path:

    POST   /responses              create (stream: typed SSE events; background: reply at once, generate on)
    GET    /responses/{id}         a stored response, as it stands
    DELETE /responses/{id}         forget it (and stop it, if it is still generating)
    POST   /responses/{id}/cancel  stop a response that is still generating

A request becomes a chat request (translate.py) and is planned as a chat completion is (openai/translate.py
plan_chat); its reply (chat/reply.py) leaves as a response object or its events (format.py), and with store it is
kept (store.py). The blueprint is registered under the OpenAI API's prefixes, its names starting with "openai":
errors come in OpenAI's envelope and metrics count its requests under "openai".
"""

from __future__ import annotations

import contextvars
import threading
from typing import Iterator, Optional

from flask import Blueprint, current_app, jsonify

from gateway.chat.plan import Plan
from gateway.chat.reply import CallArguments, CallBegan, CallEnded, Finished, Piece, Replies, Reply
from gateway.errors import APIError, BadRequest, from_exception
from gateway.openai.format import error_body
from gateway.openai.responses import format as wire
from gateway.openai.responses.schemas import ResponseCreateRequest
from gateway.openai.responses.store import ResponseStore, StoredResponse
from gateway.openai.responses.translate import chat_request, in_responses_terms
from gateway.openai.translate import plan_chat
from gateway.web import held_sessions
from gateway.web.access import client_id
from gateway.web.bodies import json_body
from gateway.web.current_engine import get_engine
from gateway.web.sse import event_stream

blueprint = Blueprint("openai_responses", __name__)
CANCEL_WAIT_SECONDS = 10.0  # how long a cancel waits for the generation to stop at its next token


@blueprint.record_once
def _install_store(state) -> None:
    limits = state.app.extensions["engine"].limits
    state.app.extensions["responses_store"] = ResponseStore(limits.max_stored_responses,
                                                            limits.stored_response_idle_timeout,
                                                            limits.max_stored_response_bytes)


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
        plan = plan_chat(engine, chat)
    run = ResponseRun(wire.response_object(wire.new_id("resp"), plan.model.name, fields), plan, engine.stats.begin())
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


# ------------------------------------------------------------------------------------------ one response


class ResponseRun:
    """One response generated: its events as they come (streamed, or run through whole), its stored record (if
    any) kept current. Its output items, in order: a thinking model's reasoning, the message (any text), then a
    function call per tool call, each told as it is written; the response's output is the items as told."""

    def __init__(self, body: dict, plan: Plan, stats):
        self.body, self.prompt_tokens, self.cached_tokens = body, len(plan.prompt_ids), plan.cached_tokens
        self.replies = Replies(plan, stats)
        self.event = wire.EventCounter()
        self.output: list[dict] = []  # the items closed so far; an item's output index is its place here
        self.reasoning_id = wire.new_id("rs")
        self.reasoning: Optional[str] = None  # the reasoning told so far; None until the reasoning item begins
        self.reasoning_done = False
        self.message_id: Optional[str] = None  # the message item open, and its text so far
        self.message_text = ""
        self.call: Optional[dict] = None  # the function call item open
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
            reply = yield from self.generated(lambda: gone() or self.cancel.is_set())
            yield from self.finished(reply)
        except Exception as error:  # once the response has begun, an error is its last event, never a traceback
            self.failure = from_exception(error)
            self.update(status="failed", error=wire.failure(self.failure), usage=self.usage())
            yield self.event("response.failed", response=self.body)
        finally:
            if self.record is not None:
                self.store.finish(self.record)

    def generated(self, cancelled) -> Iterator[dict]:
        """The items' events as the reply's events come; returns the reply."""
        reply = Reply(0)
        for event in self.replies.events(cancelled):
            if isinstance(event, Piece):
                yield from self.reasoning_events(event.reasoning)
                if event.text:
                    yield from self.text_events(event.text)
            elif isinstance(event, CallBegan):
                yield from self.call_begun(event.name)
            elif isinstance(event, CallArguments):
                self.call["arguments"] += event.fragment
                yield wire.call_arguments_delta(self.event, len(self.output), self.call["id"], event.fragment)
            elif isinstance(event, CallEnded):
                yield from self.call_ended("completed" if event.complete else "incomplete")
            elif isinstance(event, Finished):
                reply = event.reply
        return reply

    def reasoning_events(self, text: str) -> Iterator[dict]:
        if not text:
            return
        if self.reasoning is None:
            self.reasoning = ""
            yield from wire.reasoning_start(self.event, 0, self.reasoning_id)
        self.reasoning += text
        yield wire.reasoning_delta(self.event, 0, self.reasoning_id, text)

    def reasoning_end(self) -> Iterator[dict]:
        """The reasoning item's last events (once, before the first of the message's or calls')."""
        if self.reasoning is not None and not self.reasoning_done:
            self.reasoning_done = True
            item = wire.reasoning_item(self.reasoning_id, "completed", self.reasoning)
            self.output.append(item)
            yield from wire.reasoning_end(self.event, 0, item)

    def text_events(self, text: str) -> Iterator[dict]:
        yield from self.reasoning_end()
        if self.message_id is None:
            self.message_id, self.message_text = wire.new_id("msg"), ""
            yield from wire.message_start(self.event, len(self.output), self.message_id)
        self.message_text += text
        if text:
            yield wire.text_delta(self.event, len(self.output), self.message_id, text)

    def message_end(self, status: str) -> Iterator[dict]:
        if self.message_id is not None:
            item = wire.message_item(self.message_id, status, self.message_text)
            self.message_id = None
            self.output.append(item)
            yield from wire.message_end(self.event, len(self.output) - 1, item)

    def call_begun(self, name: str) -> Iterator[dict]:
        """A function call's item opens: whatever came before it is closed."""
        yield from self.reasoning_end()
        yield from self.message_end("completed")
        self.call = wire.function_call_item(name)
        yield wire.call_start(self.event, len(self.output), self.call)

    def call_ended(self, status: str) -> Iterator[dict]:
        item, self.call = {**self.call, "status": status}, None
        self.output.append(item)
        yield from wire.call_end(self.event, len(self.output) - 1, item)

    def finished(self, reply: Reply) -> Iterator[dict]:
        """The output items' last events, then the response's: completed, or incomplete (cut short, cancelled).
        A reply that told neither text nor calls is an empty message."""
        yield from self.reasoning_end()
        calls = [item for item in self.output if item["type"] == "function_call" and item["status"] == "completed"]
        if not calls and self.message_id is None and all(item["type"] == "reasoning" for item in self.output):
            yield from self.text_events("")
        yield from self.message_end("completed" if reply.finish_reason == "stop" or calls else "incomplete")
        status = {"stop": "completed", "length": "incomplete", "cancelled": "cancelled"}[reply.finish_reason]
        told = "".join(item["content"][0]["text"] for item in self.output if item["type"] == "message")
        self.conversation = self.conversation + [reply_message(told if calls else reply.text, calls)]
        self.update(status=status, output=list(self.output), usage=self.usage(), completed_at=wire.now(),
                    incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None)
        yield self.event(wire.FINAL_EVENTS[status], response=self.body)

    def usage(self) -> dict:
        return wire.usage(self.prompt_tokens, self.replies.tokens, self.cached_tokens,
                          self.replies.reasoning_tokens or 0)

    def update(self, **changes) -> None:
        """A new body (readers of the stored one see either the old or the new, whole)."""
        self.body = {**self.body, **changes}
        if self.record is not None:
            self.record.body, self.record.conversation = self.body, self.conversation


def reply_message(text: str, calls: Optional[list[dict]]) -> dict:
    """The reply as the chat message that a follow-up's conversation holds (a call cut short is left out: its text
    is the message's, as the model wrote it)."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": [
        {"id": call["call_id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
        for call in calls]}
