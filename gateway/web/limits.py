"""The limits that keep one client from crowding out the others (config.Limits), enforced before any route:

    install(app, limits)    the body size (413) and each client's requests per minute (429), before any route;
                            and the open WebSockets, overall and per client (429 before the upgrade)
    charge_request()        the same rate limit, for each message on a WebSocket
    check_input_count()     a request's inputs (embeddings, choices) under the per-request cap, and
    check_input_tokens()    their tokens together
    work_slot(engine)       one of the client's session slots, held while a request without a session runs its
                            cache-less forwards (embeddings, /v1/chooses): such work counts like a generation's

A request's own lengths (token budget, context) are checked where it is translated (engine/lengths.py); the cap on
open sessions lives with the sessions (engine/sessions.py); the idle timeouts there and in petals/websocket.py.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

from flask import current_app, g, request

from config import Limits
from gateway.errors import BadRequest, PayloadTooLarge, RateLimited, TooManyWebSockets
from gateway.web.access import client_id, is_open


def install(app, limits: Limits) -> None:
    """Install after access.install: a caller's key decides which allowance a request is charged to."""
    most = limits.max_body_bytes
    # werkzeug stops reading a chunked body (no Content-Length) at MAX_CONTENT_LENGTH, silently: one byte more
    # tells a body over the limit from one just at it
    app.config["MAX_CONTENT_LENGTH"] = most + 1
    app.config["MAX_FORM_MEMORY_SIZE"] = most  # a form field alone over it is werkzeug's 413 (errors.py)
    app.extensions["rate_limiter"] = RateLimiter(limits.requests_per_minute)
    websockets = app.extensions["websocket_slots"] = WebSocketSlots(limits.max_websockets,
                                                                    limits.max_websockets_per_client)

    @app.before_request
    def check_request():
        size = request.content_length
        if size is None and "chunked" in request.headers.get("Transfer-Encoding", "").lower():
            size = len(request.get_data(cache=True))  # kept for the route: read once, up to most + 1 bytes
        if size is not None and size > most:
            raise PayloadTooLarge(f"the request body is over this gateway's limit of {most} bytes (MAX_BODY_BYTES)")
        if request.method != "OPTIONS" and not is_open(request.path):
            charge_request()
        if request.url_rule is not None and request.url_rule.websocket:  # a handshake the WebSocket route takes
            g.websocket_slot = websockets.take(client_id())

    @app.teardown_request
    def give_back_websocket_slot(_error):  # a WebSocket's request ends when its connection does
        if "websocket_slot" in g:
            websockets.give_back(g.pop("websocket_slot"))


def charge_request() -> None:
    """Count one request (or WebSocket message) against the calling client's allowance."""
    current_app.extensions["rate_limiter"].charge(client_id())


def check_input_count(limits: Limits, field: str, count: int) -> None:
    """`count` inputs in field `field` of one request: a 400 over MAX_INPUTS_PER_REQUEST. Each input is a forward
    through the whole swarm: checked before anything is tokenized."""
    if count > limits.max_inputs_per_request:
        raise BadRequest(f"{field}: at most {limits.max_inputs_per_request} inputs in one request, got {count} "
                         "(MAX_INPUTS_PER_REQUEST)", field=field)


def check_input_tokens(limits: Limits, field: str, tokens: int) -> None:
    """The tokens of a request's inputs together: a 400 over MAX_INPUT_TOKENS_PER_REQUEST."""
    if tokens > limits.max_input_tokens_per_request:
        raise BadRequest(f"{field}: at most {limits.max_input_tokens_per_request} tokens in one request, all inputs "
                         f"together, got {tokens} (MAX_INPUT_TOKENS_PER_REQUEST)", field=field)


@contextmanager
def work_slot(engine) -> Iterator[None]:
    """A slot among the client's sessions (MAX_SESSIONS_PER_CLIENT and MAX_SESSIONS), held while
    the request runs forwards that need no session: without it, a few such requests hold every gateway thread for
    as long as their inputs take, and no cap sees them (over a cap: 429 too_many_sessions)."""
    with engine.session_slot(client_id()):
        yield


class RateLimiter:
    """A token bucket per client: a burst of up to a minute's allowance, refilled steadily.

    Our own rather than flask-limiter or limits: gunicorn runs one worker process, so in-memory state is the
    whole truth, and a bucket is a few lines; those libraries bring storage backends, decorators and replies of
    their own that would still have to be turned into our two error formats."""

    PRUNE_ABOVE = 10_000  # clients remembered before the full (idle) buckets are forgotten

    def __init__(self, per_minute: int):
        self.per_minute = per_minute
        self.per_second = per_minute / 60.0
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, when they were counted)
        self._prune_above = self.PRUNE_ABOVE  # doubles while most clients are busy: pruning stays rare
        self._lock = threading.Lock()

    def charge(self, client: str) -> None:
        if self.per_minute <= 0:
            return
        now = time.monotonic()
        with self._lock:
            tokens = self._tokens(client, now)
            if tokens < 1:
                wait = math.ceil((1 - tokens) / self.per_second)
                raise RateLimited(f"too many requests: at most {self.per_minute} per minute per client "
                                  f"(REQUESTS_PER_MINUTE); retry in {wait} s", retry_after=wait)
            self._buckets[client] = (tokens - 1, now)
            if len(self._buckets) > self._prune_above:
                self._forget_full(now)
                self._prune_above = max(self.PRUNE_ABOVE, 2 * len(self._buckets))

    def _tokens(self, client: str, now: float) -> float:
        tokens, counted_at = self._buckets.get(client, (self.per_minute, now))
        return min(self.per_minute, tokens + (now - counted_at) * self.per_second)

    def _forget_full(self, now: float) -> None:
        """A full bucket is what a new client gets anyway."""
        for client in [client for client in self._buckets if self._tokens(client, now) >= self.per_minute]:
            del self._buckets[client]


class WebSocketSlots:
    """Open WebSocket connections, overall and per client. Each holds a gunicorn thread for its whole life, and
    the threads are sized from these caps (config.Limits.worker_threads): refusing the handshake past them is what
    keeps WebSockets from taking the threads that HTTP requests (/health too) need."""

    def __init__(self, most: int, per_client: int):
        self.most, self.per_client = most, per_client or most
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()

    def take(self, client: str) -> str:
        with self._lock:
            if self._open.total() >= self.most:
                raise TooManyWebSockets(f"too many open WebSockets on this gateway ({self.most}, MAX_WEBSOCKETS); "
                                        "retry later")
            if self._open[client] >= self.per_client:
                raise TooManyWebSockets(f"this client holds {self.per_client} open WebSockets, the most it may "
                                        "(MAX_WEBSOCKETS_PER_CLIENT); close one or retry later")
            self._open[client] += 1
        return client

    def give_back(self, client: str) -> None:
        with self._lock:
            self._open[client] -= 1
            if self._open[client] <= 0:
                del self._open[client]

    def __len__(self) -> int:
        return self._open.total()

