"""The inference sessions a request opens for itself, closed whatever becomes of the request.

The OpenAI-style APIs (OpenAI's, Anthropic's, Ollama's, the Responses API) open their sessions before they
answer, one per prompt (chat/plan.py Plan), so that a refusal (429, 503) is a status rather than an event in
a stream. Those sessions then belong to the request until its reply has run, and every way a request can end
must close them: a later prompt failing a check or over a limit, a generation raising, a client leaving
mid-stream, a stream never read at all. A session that is not closed holds its slot under MAX_SESSIONS and
MAX_SESSIONS_PER_CLIENT, and its pages of cache on every server of its chain, for as long as the gateway runs.
(A Plan's close() gives its session back to the engine, which parks it for the client's next request or
closes it: engine/warm.py. Either way the request's slot is free.)

    hold(choices)           what opened a session (anything with an idempotent close()) is now this request's
    hand_over() -> release  the reply outlives the view (sse.py, ndjson.py, a background response): it takes
                            the request's sessions and calls release() once it has ended, or will never start
    install(app)            the teardown of every request closes what the request still holds: a view that
                            raised, and (again: closing is idempotent) a reply that ran whole inside the view

The WebSocket API and the Petals HTTP API own their sessions otherwise (a connection's, an id's): not here.
"""

from __future__ import annotations

import logging
import threading

from flask import g, has_request_context

logger = logging.getLogger(__name__)
_KEY = "held_sessions"


def hold(closeable) -> None:
    if has_request_context():  # outside a request (a unit test, a tool), the caller closes what it opens
        g.setdefault(_KEY, []).append(closeable)


def hand_over() -> "Release":
    """The request's sessions, now the caller's: it must call the result once its reply has ended."""
    return Release(g.pop(_KEY, []) if has_request_context() else [])


class Release:
    """Closes what it was handed, once, from whichever thread calls it first."""

    def __init__(self, held: list):
        self._held, self._lock = held, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        close_all(held)


def close_all(held: list) -> None:
    for closeable in held:
        try:
            closeable.close()
        except Exception:  # one failure must not keep the others open
            logger.exception("closing a request's session failed")


def install(app) -> None:
    @app.teardown_request
    def close_held_sessions(_error) -> None:
        close_all(g.pop(_KEY, []))
