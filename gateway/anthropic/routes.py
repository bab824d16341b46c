"""Anthropic's Messages API under /v1: a thin translator onto the chat path, as vLLM's is.

    POST /v1/messages               a message, or (stream: true) its events over SSE
    POST /v1/messages/count_tokens  {"input_tokens": n}: the prompt that /v1/messages would run for this body

A request is read into schemas.py's shapes, translated once into chat's terms (translate.py), planned on the chat
path (chat/plan.py) and its reply (chat/reply.py) written in Anthropic's wire format (format.py). Errors take
Anthropic's envelope (format.error_body) for the requests that `speaks` says are Anthropic's.
"""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from gateway.anthropic import format as wire
from gateway.anthropic.schemas import AnthropicCountTokensRequest, AnthropicMessagesRequest
from gateway.anthropic.translate import prompt_of, sampling_fields, thinking_of
from gateway.chat.plan import plan_generation
from gateway.chat.reasoning import reply_thinking
from gateway.web.bodies import json_body
from gateway.web.current_engine import get_engine
from gateway.web.sse import event_stream

blueprint = Blueprint("anthropic", __name__)
PREFIX = "/v1"
MESSAGES_PATH = PREFIX + "/messages"
error_body = wire.error_body


def register(app) -> None:
    app.register_blueprint(blueprint, url_prefix=PREFIX)


def speaks() -> bool:
    """Whether this request's errors take Anthropic's envelope: its routes, unknown paths under /v1/messages, and
    unknown paths asked for by Anthropic's clients (they send anthropic-version with every request)."""
    if request.blueprint is not None:
        return request.blueprint.startswith("anthropic")
    path = request.path
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/") or "anthropic-version" in request.headers


@blueprint.post("/messages")
def messages():
    fields = json_body(AnthropicMessagesRequest)
    engine = get_engine()
    model = engine.model(fields.model)
    prompt_ids, tool_choice = prompt_of(model, fields)
    thinking = reply_thinking(model.tokenizer, prompt_ids, thinking_of(fields))
    plan = plan_generation(engine, model, sampling_fields(fields), prompt_ids, "messages", tool_choice,
                           thinking=thinking)
    reply = wire.MessageReply(plan, engine.stats.begin())
    if not fields.stream:
        return jsonify(reply.message())
    return event_stream(reply.events, wire.error_body, named=True)


@blueprint.post("/messages/count_tokens")
def count_tokens():
    fields = json_body(AnthropicCountTokensRequest)
    prompt_ids, _ = prompt_of(get_engine().model(fields.model), fields)
    return jsonify(input_tokens=len(prompt_ids))
