"""A request id for every request, on its reply and on every log line it causes.

The id is the request's X-Request-ID when a client or a proxy sends a sane one (so that one id follows a request
through every hop), else a new one; the reply carries it back in X-Request-ID. It lives in a context variable,
so log records made anywhere below a request (the engine, the swarm client) carry it through a logging filter,
and threads started for a request (an SSE stream's producer) carry it when they run in a copy of the context.
A WebSocket connection is one request: all its messages share the id of its handshake.
"""

from __future__ import annotations

import logging
import re
import uuid
from contextvars import ContextVar

from flask import Flask, g, request

HEADER = "X-Request-ID"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"

current: ContextVar[str] = ContextVar("request_id", default="-")
# Anything else a client sends is replaced: an id goes into every log line, so it must not forge or break one.
_SANE_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def install(app: Flask) -> None:
    """Give each request its id. Install first, so that even a request refused by a later hook gets one."""

    @app.before_request
    def take_request_id():
        given = request.headers.get(HEADER, "")
        g.request_id_token = current.set(given if _SANE_ID.fullmatch(given) else uuid.uuid4().hex)

    @app.after_request
    def return_request_id(response):
        response.headers[HEADER] = current.get()
        return response

    @app.teardown_request
    def forget_request_id(_error):
        token = g.pop("request_id_token", None)
        if token is not None:  # gthread reuses threads: the next request there must not inherit this id
            current.reset(token)


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current.get()
        return True


def configure_logging(level: str = "INFO") -> None:
    """Log records of this process to stderr, each with its request id ('-' outside requests).

    Called by the gunicorn entry point (app.py), not by create_app: a test's Flask client keeps pytest's logging.
    Once per process: `python app.py` imports app.py twice (as __main__, then as gunicorn's app:app)."""
    root = logging.getLogger()
    root.setLevel(level)
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # huggingface_hub's: a line per request to the Hub
    if any(isinstance(handler.filters[0], RequestIdFilter) for handler in root.handlers if handler.filters):
        return
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
