"""Petals Chat's WebSocket API, /api/v2/generate: one inference session per connection.

    -> {type: "open_inference_session", model?, max_length}          <- {ok: true}
    -> {type: "generate", inputs, max_new_tokens, stop_sequence?, ...} <- {ok, outputs, stop, token_count} ...
       or {type: "generate", messages: [new chat turns], stream: true, max_reply_tokens?, regenerate?}
    -> {type: "stop"}                    ends the reply being generated (its last frame has stop: true);
                                         the session stays open for the next generate
    -> {type: "close_inference_session"} <- {ok: true}

With a stop_sequence (or extra_stop_sequences, or stream: true), generation goes on until a stop, the
session's end or max_reply_tokens, in frames of max_new_tokens tokens each; otherwise one frame of at most
max_new_tokens tokens. The last frame of a reply has stop: true and a finish_reason.
Chat mode (`messages`) renders turns with the model's chat template and keeps the transcript, so each turn
sends only its new text; `regenerate` rewinds the session to the start of the last reply.
Any error is a frame {ok: false, error, traceback}, after which the connection stays usable.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import replace

from flask import Blueprint
from flask_sock import Sock
from simple_websocket import ConnectionClosed

from gateway import metrics
from gateway.engine import Engine
from gateway.errors import BadRequest, error_body, from_exception
from gateway.http_api import generation_request, get_engine
from gateway.prompts import render_chat
from gateway.schemas import ChatMessage, WsCloseSession, WsGenerate, WsMessage, WsOpenSession, WsStop, parse

logger = logging.getLogger(__name__)
blueprint = Blueprint("petals_ws", __name__)
sock = Sock()


@sock.route("/api/v2/generate", bp=blueprint)
def generate_ws(ws):
    Connection(ws, get_engine()).serve()


class Connection:
    def __init__(self, ws, engine: Engine):
        self.ws, self.engine = ws, engine
        self.session = None
        self.chat = ChatTranscript(engine)
        self.inbox: deque[str] = deque()  # messages that arrived while a reply was being generated

    def serve(self) -> None:
        try:
            while True:
                raw = self.inbox.popleft() if self.inbox else self.ws.receive()
                if raw is None:
                    return
                try:
                    self.handle(raw)
                    metrics.count_ws_message(200)
                except ConnectionClosed:
                    raise  # flask-sock ends the connection quietly
                except Exception as error:
                    api_error = from_exception(error)
                    metrics.count_ws_message(api_error.status)  # each message once, with its reply's status
                    self.send(error_body(api_error))
        finally:
            self.close_session()

    def handle(self, raw) -> None:
        try:
            data = json.loads(raw)
        except (TypeError, ValueError) as error:
            raise BadRequest(f"the message is not valid JSON: {error}") from None
        message = parse(WsMessage, data)
        if isinstance(message, WsOpenSession):
            self.close_session()  # opening again starts a new conversation on the same connection
            self.session = self.engine.open_session(message.model, message.max_length, expires=False)
            self.send({"ok": True})
        elif isinstance(message, WsGenerate):
            self.generate(message)
        elif isinstance(message, WsCloseSession):
            self.close_session()
            self.send({"ok": True})
        elif isinstance(message, WsStop):
            pass  # nothing is being generated: there is nothing to stop

    def generate(self, message: WsGenerate) -> None:
        if self.session is None:
            raise BadRequest("no inference session: send open_inference_session first", field="type")
        streaming = message.stream or bool(message.stop_sequences())
        request = generation_request(message, self.session.model.config, self.engine.limits.max_new_tokens, streaming)
        if streaming and message.max_reply_tokens:
            request = replace(request, max_new_tokens=message.max_reply_tokens)
        chunk_size = (message.max_new_tokens or 1) if streaming else None
        text, tokens, reply = "", 0, []
        with self.engine.sessions.use(self.session.id) as session:
            if message.regenerate:
                self.rewind_last_reply(session)
            if message.messages is not None:
                request = replace(request, inputs=self.chat.turns(session, message.messages))
            for delta in self.engine.generate(session, request, cancelled=self.stop_requested):
                text, tokens = text + delta.text, tokens + delta.token_count
                reply.append(delta.text)
                if delta.finish_reason or (chunk_size and tokens >= chunk_size):
                    frame = {"ok": True, "outputs": text, "stop": delta.finish_reason is not None, "token_count": tokens}
                    if delta.finish_reason:
                        frame["finish_reason"] = delta.finish_reason
                    self.send(frame)
                    text, tokens = "", 0
            self.chat.replied("".join(reply))

    def rewind_last_reply(self, session) -> None:
        if session.reply_start is None:
            raise BadRequest("regenerate: there is no reply to regenerate yet", field="regenerate")
        self.engine.rewind(session, session.reply_start)
        self.chat.forget_last_reply()

    def stop_requested(self) -> bool:
        """Between two tokens: has the client asked to stop? Other messages wait in the inbox."""
        while (raw := self.ws.receive(timeout=0)) is not None:
            try:
                if json.loads(raw).get("type") == "stop":
                    return True
            except (TypeError, ValueError, AttributeError):
                pass
            self.inbox.append(raw)
        return False

    def send(self, frame: dict) -> None:
        self.ws.send(json.dumps(frame, ensure_ascii=False))

    def close_session(self) -> None:
        self.chat = ChatTranscript(self.engine)
        if self.session is not None:
            session, self.session = self.session, None
            self.engine.close_session(session)


class ChatTranscript:
    """Chat mode: the conversation so far, rendered with the model's chat template, so that each turn sends
    the swarm only the text that the session does not hold yet."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.messages: list = []

    def turns(self, session, new_messages: list) -> str:
        """The new text for the session: the whole rendered transcript minus what the session already holds."""
        self.messages += new_messages
        tokenizer = session.model.tokenizer
        rendered = render_chat(tokenizer, self.messages, None)
        held = tokenizer.decode(session.history + session.pending)
        if rendered.startswith(held):
            return rendered[len(held):]
        # the template rewrote an earlier turn (some trim or reformat replies): start the session over
        self.engine.rewind(session, 0)
        return rendered

    def replied(self, text: str) -> None:
        if self.messages:
            self.messages.append(ChatMessage(role="assistant", content=text))

    def forget_last_reply(self) -> None:
        if self.messages and self.messages[-1].role == "assistant":
            self.messages.pop()
