"""Server-sent events for streamed replies: keep-alive comments on long pauses, an error as a final event,
and a client that goes away cancels the generation (which then closes its swarm session).

The stream takes over the sessions its request opened (web/held_sessions.py): the producer closes whatever is left
of them when it ends, and a stream that never starts (a client gone before the first write) closes them when
gunicorn closes the response.

The events are produced on a thread of their own, so that a silent stretch (a long prompt, a slow swarm)
can still be filled with keep-alive comments, and so that the response notices a closed connection at
the next write, whatever the producer is doing.
"""

from __future__ import annotations

import contextvars
import json
import queue
import threading
from typing import Callable, Iterator

from flask import Response

from gateway.web import held_sessions
from gateway.errors import from_exception

KEEPALIVE_SECONDS = 10.0
_END = object()


def event_stream(events: Callable[[Callable[[], bool]], Iterator[dict]], error_body: Callable,
                 keepalive: float = KEEPALIVE_SECONDS, named: bool = False) -> Response:
    """`events(cancelled)` yields the JSON events; it should stop when `cancelled()` turns true.

    `named`: typed events (OpenAI's Responses API, Anthropic's Messages API): each event's `type` is also its SSE
    `event:` name, and no `data: [DONE]` follows, since the last event says that the reply is over."""
    outbox: queue.Queue = queue.Queue()
    gone = threading.Event()
    release = held_sessions.hand_over()
    producing = threading.Event()  # set once the producer runs: from then on it alone releases the sessions
    # the producer runs in this request's context (its request id), though the stream starts after the request's
    # teardown, when gunicorn iterates the response
    context = contextvars.copy_context()

    def produce():
        try:
            for event in events(gone.is_set):
                outbox.put(event)
        except Exception as error:  # once a stream has started, an error is its last event, never a traceback
            outbox.put(error_body(from_exception(error)))
        finally:
            release()  # before the end goes out: a client that read the whole reply finds nothing held
            outbox.put(_END)

    def stream():
        producing.set()
        producer = threading.Thread(target=context.run, args=(produce,), name="sse-producer", daemon=True)
        producer.start()
        try:
            while True:
                try:
                    event = outbox.get(timeout=keepalive)
                except queue.Empty:
                    yield ": keep-alive\n\n"
                    continue
                if event is _END:
                    break
                name = f"event: {event['type']}\n" if named and "type" in event else ""
                yield f"{name}data: {json.dumps(event, ensure_ascii=False)}\n\n"
            if not named:
                yield "data: [DONE]\n\n"
        finally:  # also when the client went away: gunicorn closes this generator at the failed write
            gone.set()

    response = Response(stream(), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    # closed without a first read, the stream never ran (gunicorn closes every response, read or not)
    response.call_on_close(lambda: None if producing.is_set() else release())
    return response
