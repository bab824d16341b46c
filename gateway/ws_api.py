"""Petals Chat's WebSocket API, /api/v2/generate: one inference session per connection.

    -> {type: "open_inference_session", model?, max_length}          <- {ok: true}
    -> {type: "generate", inputs, max_new_tokens, stop_sequence?, ...} <- {ok, outputs, stop, token_count} ...
    -> {type: "stop"}                    ends the reply being generated (its last frame has stop: true);
                                         the session stays open for the next generate
    -> {type: "close_inference_session"} <- {ok: true}

With a stop_sequence (or extra_stop_sequences), generation goes on until one appears or the session is
full, in frames of max_new_tokens tokens each; without, one frame of at most max_new_tokens tokens.
Any error is a frame {ok: false, error, traceback}, after which the connection stays usable.
"""

from __future__ import annotations

import json
import logging
from collections import deque

from flask import Blueprint
from flask_sock import Sock
from simple_websocket import ConnectionClosed

from gateway.engine import Engine
from gateway.errors import BadRequest, error_body, from_exception
from gateway.http_api import generation_request, get_engine
from gateway.schemas import WsCloseSession, WsGenerate, WsMessage, WsOpenSession, WsStop, parse

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
        self.inbox: deque[str] = deque()  # messages that arrived while a reply was being generated

    def serve(self) -> None:
        try:
            while True:
                raw = self.inbox.popleft() if self.inbox else self.ws.receive()
                if raw is None:
                    return
                try:
                    self.handle(raw)
                except ConnectionClosed:
                    raise  # flask-sock ends the connection quietly
                except Exception as error:
                    self.send(error_body(from_exception(error)))
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
        streaming = bool(message.stop_sequences())
        request = generation_request(message, self.session.model.config, self.engine.limits.max_new_tokens, streaming)
        chunk_size = (message.max_new_tokens or 1) if streaming else None
        text, tokens = "", 0
        with self.engine.sessions.use(self.session.id) as session:
            for delta in self.engine.generate(session, request, cancelled=self.stop_requested):
                text, tokens = text + delta.text, tokens + delta.token_count
                if delta.finish_reason or (chunk_size and tokens >= chunk_size):
                    self.send({"ok": True, "outputs": text, "stop": delta.finish_reason is not None,
                               "token_count": tokens})
                    text, tokens = "", 0

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
        if self.session is not None:
            session, self.session = self.session, None
            self.engine.close_session(session)
