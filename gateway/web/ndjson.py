"""Newline-delimited JSON streams (Ollama's): a JSON object per line, an error as the last line, and a client that
goes away cancels the generation.

Unlike sse.py, there is no producer thread: NDJSON has no comment line, so a silent stretch cannot be filled with
keep-alives, and a thread would have nothing to do but wait. The lines are produced as gunicorn writes them; when
a write fails, gunicorn closes this generator, which closes the API's, and so the engine's (whose `finally` frees
the swarm session). Each step runs in a copy of the request's context, so that its log lines keep the request id.
The stream takes over the sessions its request opened (web/held_sessions.py) and closes what is left of them when
gunicorn closes the response, whether it was read to its end, cut short, or never read at all.
"""

from __future__ import annotations

import contextvars
import json
from typing import Callable, Iterable, Iterator

from flask import Response

from gateway.web import held_sessions
from gateway.errors import from_exception

MIMETYPE = "application/x-ndjson"


def ndjson_stream(lines: Iterable[dict], error_body: Callable) -> Response:
    """`lines` yields the JSON objects; a generator is closed when the stream ends or the client goes away."""
    context = contextvars.copy_context()  # taken now: the stream starts after the request's teardown
    lines = iter(lines)
    close = getattr(lines, "close", lambda: None)
    release = held_sessions.hand_over()

    def stream() -> Iterator[str]:
        try:
            while True:
                try:
                    line = context.run(next, lines)
                except StopIteration:
                    return
                except Exception as error:  # once a stream has started, an error is its last line, never a traceback
                    yield _line(error_body(context.run(from_exception, error)))
                    return
                yield _line(line)
        finally:
            context.run(close)
            release()

    response = Response(stream(), mimetype=MIMETYPE, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    response.call_on_close(release)  # also when the stream never started: no generation is running then
    return response


def _line(value: dict) -> str:
    return json.dumps(value, ensure_ascii=False) + "\n"
