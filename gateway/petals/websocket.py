"""Petals Chat's WebSocket API, /api/v2/generate: one inference session per connection.

    -> {type: "open_inference_session", model?, max_length}          <- {ok: true, session_id}
    -> {type: "open_inference_session", session_id}                  <- {ok: true, session_id}
       (resumes that session, with its own max_length and chat transcript)
    -> {type: "generate", inputs, max_new_tokens, stop_sequence?, ...} <- {ok, outputs, stop, token_count} ...
       or {type: "generate", messages: [new chat turns], stream: true, max_reply_tokens?, regenerate?}
    -> {type: "stop"}                    ends the reply being generated (its last frame has stop: true);
                                         the session stays open for the next generate
    -> {type: "close_inference_session"} <- {ok: true}

With a stop_sequence (or extra_stop_sequences, or stream: true), generation goes on until a stop, the
session's end or max_reply_tokens, in frames of max_new_tokens tokens each; otherwise one frame of at most
max_new_tokens tokens. The last frame of a reply has stop: true and a finish_reason. While the swarm has no
server for some blocks (servers restarting), a streamed reply waits (BLOCK_WAIT_SECONDS at most) and says so in
a frame with empty outputs: {ok: true, outputs: "", stop: false, token_count: 0, waiting: "no server holds ..."}.
Chat mode (`messages`) renders turns with the model's chat template and keeps the transcript, so each turn
sends only its new text; `regenerate` rewinds the session to the start of the last reply.
Any error is a frame {ok: false, error, code, traceback}, after which the connection stays usable.

A session outlives its connection (with a session store, SESSION_STORE): when the connection ends, for whatever
reason, the servers free its caches but the gateway keeps its tokens and chat transcript, and an
open_inference_session naming its session_id (on a new connection, after a gateway restart too) resumes it exactly,
for the same client (the same API key, when keys are configured), until SESSION_IDLE_TIMEOUT passes unused.
close_inference_session, or opening another session on the connection, ends it for good.

Limits: each message counts against the client's REQUESTS_PER_MINUTE (over it: an error frame, the connection
stays); a connection whose client sends nothing for WS_IDLE_TIMEOUT seconds gets an idle_timeout frame and is
closed (code 1000), which frees its session; a message over WS_MAX_MESSAGE_BYTES closes it with code 1009.
A failure outside any one message (a bug) closes it with code 1011 and a clean reason; the log has the rest.
"""

from __future__ import annotations

import json
import logging
import socket
from collections import deque
from dataclasses import replace

from flask import Blueprint
from flask_sock import Sock
from simple_websocket import ConnectionClosed
from wsproto.frame_protocol import CloseReason

from gateway.chat.prompts import render_chat
from gateway.chat.schemas import ChatMessage
from gateway.engine.generation import Engine
from gateway.errors import BadRequest, IdleTimeout, from_exception
from gateway.petals.format import error_body
from gateway.petals.schemas import WsCloseSession, WsGenerate, WsOpenSession, WsStop, parse_ws_message
from gateway.petals.translate import generation_request
from gateway.web import metrics
from gateway.web.access import client_id
from gateway.web.bodies import load_json
from gateway.web.current_engine import get_engine
from gateway.web.limits import charge_request

logger = logging.getLogger(__name__)
blueprint = Blueprint("petals_ws", __name__)
sock = Sock()


@sock.route("/api/v2/generate", bp=blueprint)
def generate_ws(ws):
    try:
        Connection(ws, get_engine(), client_id()).serve()
    finally:
        close_transport(ws)


CLOSE_LINGER = 2.0  # seconds this connection's thread waits for the client to close its side


def close_transport(ws) -> None:
    """End the TCP connection from this connection's own thread. Left to gunicorn, its one main thread closes
    each finished connection gracefully, lingering (up to 2 s) for the client's FIN, one connection after
    another and accepting nothing meanwhile: a thousand clients leaving at once held every other request for
    tens of seconds. Here each connection lingers in parallel, and gunicorn finds the socket already closed."""
    if ws.connected:
        ws.close()  # the closing handshake's frame, when the client did not start it
    try:
        ws.sock.shutdown(socket.SHUT_WR)  # our FIN: the client closes its side, and the reader thread sees it
    except OSError:
        pass  # already closed by the reader thread, after the client's close frame
    ws.thread.join(CLOSE_LINGER)
    try:
        ws.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader thread, if the client never answered
    except OSError:
        pass
    ws.sock.close()


class Connection:
    def __init__(self, ws, engine: Engine, client: str):
        self.ws, self.engine, self.client = ws, engine, client
        self.idle_timeout = engine.limits.ws_idle_timeout or None  # 0: never
        self.session = None
        self.chat = ChatTranscript(engine)
        self.inbox: deque[str] = deque()  # messages that arrived while a reply was being generated

    def serve(self) -> None:
        try:
            while (raw := self.next_message()) is not None:
                self.answer(raw)
        except ConnectionClosed:
            raise  # flask-sock ends the connection quietly
        except Exception as error:  # not one message's fault: say so in one clean line, log the rest
            from_exception(error)
            self.ws.close(reason=CloseReason.INTERNAL_ERROR, message="internal error (see the gateway's log)")
        finally:
            self.leave_session()

    def next_message(self):
        """The next message, or None once the client has been idle for too long (the connection is then closed)."""
        if self.inbox:
            return self.inbox.popleft()
        raw = self.ws.receive(timeout=self.idle_timeout)
        if raw is None:
            self.send(error_body(IdleTimeout(f"closing the connection after {self.idle_timeout:g} s without a "
                                             "message (WS_IDLE_TIMEOUT); reconnect to go on")))
            self.leave_session()  # before the close frame: a client that saw it finds the session's caches freed
            self.ws.close(reason=CloseReason.NORMAL_CLOSURE, message="idle timeout")
        return raw

    def answer(self, raw) -> None:
        """Handle one message; any error is a frame, after which the connection goes on."""
        try:
            charge_request()
            self.handle(raw)
            metrics.count_ws_message(200)
        except ConnectionClosed:
            raise
        except Exception as error:
            api_error = from_exception(error)
            metrics.count_ws_message(api_error.status)  # each message once, with its reply's status
            self.send(error_body(api_error))

    def handle(self, raw) -> None:
        message = parse_ws_message(load_json(raw, "the message"))
        if isinstance(message, WsOpenSession):
            self.close_session()  # opening again starts a new conversation on the same connection
            self.open_session(message)
            self.send({"ok": True, "session_id": self.session.id})
        elif isinstance(message, WsGenerate):
            self.generate(message)
        elif isinstance(message, WsCloseSession):
            self.close_session()
            self.send({"ok": True})
        elif isinstance(message, WsStop):
            pass  # nothing is being generated: there is nothing to stop

    def open_session(self, message: WsOpenSession) -> None:
        if message.session_id is None:
            self.session = self.engine.open_session(message.model, message.max_length, expires=False, owner=self.client)
            self.engine.keep_session(self.session)  # its id resumes it on another connection, after a restart too
            return
        session = self.engine.resume_session(message.session_id, self.client)
        if message.model and self.engine.model_config(message.model).name != session.model.name:
            self.engine.detach_session(session)
            session.close()
            raise BadRequest(f"model: session {session.id} serves {session.model.name}", field="model")
        session.expires = False  # it lives with this connection now
        self.session, self.chat = session, ChatTranscript.resumed(self.engine, session)

    def generate(self, message: WsGenerate) -> None:
        if self.session is None:
            raise BadRequest("no inference session: send open_inference_session first", field="type")
        streaming = message.stream or bool(message.stop_sequences())
        request = generation_request(message, self.session.model.config, self.engine.limits.max_new_tokens, streaming)
        if streaming and message.max_reply_tokens:
            request = replace(request, max_new_tokens=message.max_reply_tokens)
        chunk_size = (message.max_new_tokens or 1) if streaming else None
        # a streamed reply's client reads any number of frames: it may be told of a wait (see waiting_frame)
        waits = self.waiting_frame if streaming else None
        with self.engine.use_session(self.session.id) as session, session.waits_told_to(waits):
            if message.regenerate:
                self.rewind_last_reply(session)
            length, reply_start = len(session.history) + len(session.pending), session.reply_start
            try:
                if message.messages is not None:
                    request = replace(request, inputs=self.chat.turns(session, message.messages))
                reply, last_frame = self.send_reply(session, request, chunk_size)
            except BaseException:  # the turn failed (too long, the swarm gone, the client gone): it never happened
                session.settle()  # its reply, if one was still running, ends first
                self.chat.forget_turn()
                if len(session.history) + len(session.pending) != length:
                    self.engine.rewind(session, length)
                session.reply_start = reply_start  # what a regenerate goes back to: the last reply that was
                raise
            self.chat.replied(reply)
            self.chat.keep_in(session)  # saved with the session as the request ends (sessions.use)
        # the reply's last frame once the session is saved: a client that has read a whole reply finds it stored
        # if the gateway dies the next moment
        self.send(last_frame)

    def send_reply(self, session, request, chunk_size) -> tuple[str, dict]:
        """Generate the reply in frames of `chunk_size` tokens (None: one frame); return its whole text and its
        last frame, which the caller sends."""
        text, tokens, reply, finish_reason = "", 0, [], None
        for delta in self.engine.generate(session, request, cancelled=self.stop_requested):
            text, tokens, finish_reason = text + delta.text, tokens + delta.token_count, delta.finish_reason
            reply.append(delta.text)
            if chunk_size and tokens >= chunk_size and not finish_reason:
                self.send({"ok": True, "outputs": text, "stop": False, "token_count": tokens})
                text, tokens = "", 0
        last_frame = {"ok": True, "outputs": text, "stop": True, "token_count": tokens}
        if finish_reason:
            last_frame["finish_reason"] = finish_reason
        return "".join(reply), last_frame

    def waiting_frame(self, message: str) -> None:
        """The swarm has no server for some blocks now; the reply goes on once one serves them. An empty output
        frame, so that clients that only read outputs (Petals Chat appends them) are not thrown off. Only within
        a streamed reply: elsewhere clients take the first frame after a message as its answer."""
        self.send({"ok": True, "outputs": "", "stop": False, "token_count": 0, "waiting": message})

    def rewind_last_reply(self, session) -> None:
        if session.reply_start is None:
            raise BadRequest("regenerate: there is no reply to regenerate yet", field="regenerate")
        self.engine.rewind(session, session.reply_start)
        self.chat.forget_last_reply()
        self.chat.keep_in(session)

    def stop_requested(self) -> bool:
        """Between two tokens: has the client asked to stop? Other messages wait in the inbox."""
        while (raw := self.ws.receive(timeout=0)) is not None:
            if _is_stop(raw):
                return True
            self.inbox.append(raw)
        return False

    def send(self, frame: dict) -> None:
        try:
            self.ws.send(json.dumps(frame, ensure_ascii=False))
        except OSError:  # the client went away mid-reply: as for a close, not a failure of ours
            raise ConnectionClosed() from None

    def close_session(self) -> None:
        """End the session for good: the servers free its caches, and the store forgets it."""
        self.chat = ChatTranscript(self.engine)
        if self.session is not None:
            session, self.session = self.session, None
            self.engine.close_session(session)

    def leave_session(self) -> None:
        """The connection ends: the servers free the session's caches, the store keeps it for a resume."""
        if self.session is not None:
            session, self.session = self.session, None
            self.engine.detach_session(session)
            session.close()


def _is_stop(raw) -> bool:
    try:
        message = load_json(raw, "the message")
    except BadRequest:
        return False  # answered in turn, from the inbox
    return isinstance(message, dict) and message.get("type") == "stop"


class ChatTranscript:
    """Chat mode: the conversation so far, rendered with the model's chat template, so that each turn sends
    the swarm only the text that the session does not hold yet. A turn's messages join it with their reply, never
    before: a turn whose generation fails (too long for the session, say) is forgotten, so that the next turn (or
    the same one again) is rendered without it."""

    def __init__(self, engine: Engine, messages: list | None = None):
        self.engine = engine
        self.messages: list = messages or []
        self.turn: list = []  # the messages of the turn being generated

    @classmethod
    def resumed(cls, engine: Engine, session) -> "ChatTranscript":
        """The transcript a stored session was saved with (keep_in)."""
        return cls(engine, [ChatMessage.model_validate(message) for message in session.state.get("chat", [])])

    def keep_in(self, session) -> None:
        """The transcript into the session's state, which the session store saves with it."""
        session.state["chat"] = [message.model_dump(mode="json", exclude_none=True) for message in self.messages]

    def turns(self, session, new_messages: list) -> str:
        """The new text for the session: the whole rendered transcript minus what the session already holds."""
        self.turn = list(new_messages)
        tokenizer = session.model.tokenizer
        rendered = render_chat(tokenizer, self.messages + self.turn, None)
        held = tokenizer.decode(session.history + session.pending)
        if rendered.startswith(held):
            return rendered[len(held):]
        # the template rewrote an earlier turn (some trim or reformat replies): start the session over
        self.engine.rewind(session, 0)
        return rendered

    def replied(self, text: str) -> None:
        if self.messages or self.turn:
            self.messages += self.turn + [ChatMessage(role="assistant", content=text)]
        self.turn = []

    def forget_turn(self) -> None:
        self.turn = []

    def forget_last_reply(self) -> None:
        if self.messages and self.messages[-1].role == "assistant":
            self.messages.pop()
