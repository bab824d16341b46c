"""MLC-Chat's stateful chat, as its older REST server had it: the conversation is kept on the server.

    POST /chat/completions   the request's messages continue the client's conversation; the reply joins it
    GET|POST /chat/reset     the client's conversation starts over

A conversation is the client's (its API key, or its address: access.client_id) and the model's. The gateway keeps
its messages; the servers keep its caches, through the warm sessions that every chat request reuses
(engine/warm.py): each turn computes only its new messages. The body is OpenAI's chat completion request (MLC's
fields included); the reply is OpenAI's too, streamed or not. Conversations live in the process's memory, the
least recently used forgotten past MAX_CONVERSATIONS; a turn that fails leaves the conversation as it was.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Iterator

from flask import Blueprint, current_app, jsonify, request

from gateway.chat.params import requested_top_logprobs
from gateway.chat.schemas import ChatMessage
from gateway.openai import format as wire
from gateway.openai.schemas import ChatCompletionRequest
from gateway.openai.translate import plan_chat
from gateway.web.access import caller_state_guard, client_id
from gateway.web.bodies import json_body, load_json
from gateway.web.current_engine import get_engine
from gateway.web.sse import event_stream

blueprint = Blueprint("openai_mlc_chat", __name__)  # "openai...": its errors take OpenAI's envelope (routes.speaks)
# without API keys, only where KEYLESS_SHARING says everyone behind an address is one user (web/access.py)
blueprint.before_request(caller_state_guard("stateful conversations (MLC's /chat/completions, /chat/reset)"))
MAX_CONVERSATIONS = 1024


class Conversations:
    """Each client's messages so far, by (client, model)."""

    def __init__(self, limit: int = MAX_CONVERSATIONS):
        self.limit = limit
        self._kept: OrderedDict[tuple[str, str], list[ChatMessage]] = OrderedDict()
        self._lock = threading.Lock()

    def messages(self, key: tuple[str, str]) -> list[ChatMessage]:
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
            return list(self._kept.get(key, ()))

    def extend(self, key: tuple[str, str], before: list[ChatMessage], turn: list[ChatMessage]) -> None:
        """The conversation is `before` and `turn` now, unless it was reset meanwhile (it then starts anew)."""
        with self._lock:
            self._kept[key] = (before if self._kept.get(key, []) == before else []) + turn
            self._kept.move_to_end(key)
            while len(self._kept) > self.limit:
                self._kept.popitem(last=False)

    def reset(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._kept.pop(key, None)


def conversations() -> Conversations:
    return current_app.extensions.setdefault("mlc_conversations", Conversations())


@blueprint.post("/chat/completions")
def stateful_chat_completions():
    fields = json_body(ChatCompletionRequest)
    engine = get_engine()
    key = (client_id(), engine.model(fields.model).name)
    before = conversations().messages(key)
    fields = fields.model_copy(update={"messages": before + list(fields.messages), "n": 1})
    top = requested_top_logprobs(fields)
    plan = plan_chat(engine, fields, logprobs=top)
    include_usage = bool(fields.stream_options and fields.stream_options.include_usage)
    replies = wire.ChatCompletionReplies(plan, top, include_usage, engine.stats.begin())
    remember = _remember(conversations(), key, before, fields.messages[len(before):])
    if not fields.stream:
        completion = replies.completion()
        remember(completion["choices"][0]["message"].get("content") or "")
        return jsonify(completion)
    return event_stream(_remembered_chunks(replies.chunks, remember), wire.error_body)


@blueprint.route("/chat/reset", methods=["GET", "POST"])
def reset():
    """The client's conversation with the model (the body's `model`, if any, else the default) starts over."""
    body = load_json(request.get_data()) if request.get_data() else {}
    model = body.get("model") if isinstance(body, dict) else None
    conversations().reset((client_id(), get_engine().model(model if isinstance(model, str) else None).name))
    return jsonify(ok=True)


def _remember(kept: Conversations, key, before: list[ChatMessage], asked: list[ChatMessage]) -> Callable[[str], None]:
    def remember(reply: str) -> None:
        kept.extend(key, before, [*asked, ChatMessage(role="assistant", content=reply)])

    return remember


def _remembered_chunks(chunks: Callable[[Callable[[], bool]], Iterator[dict]],
                       remember: Callable[[str], None]) -> Callable[[Callable[[], bool]], Iterator[dict]]:
    """The stream's chunks; once it has ended whole, its reply joins the conversation."""
    def events(cancelled: Callable[[], bool]) -> Iterator[dict]:
        pieces, finished = [], False
        for chunk in chunks(cancelled):
            for choice in chunk.get("choices", ()):
                pieces.append(choice["delta"].get("content") or "")
                finished = finished or choice.get("finish_reason") not in (None, "cancelled")
            yield chunk
        if finished and not cancelled():
            remember("".join(pieces))

    return events
