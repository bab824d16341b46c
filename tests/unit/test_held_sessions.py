"""held_sessions.py: what a request opened for itself is closed once, however the request ends: a view that raises,
a reply run whole, an SSE or NDJSON stream read to its end, cut short, or never read at all."""

from __future__ import annotations

import threading

import pytest
from flask import Flask

from gateway.web import held_sessions
from gateway.web.ndjson import ndjson_stream
from gateway.web.sse import event_stream


class FakeSession:
    def __init__(self):
        self.closes = 0
        self.closed = threading.Event()

    def close(self):
        self.closes += 1
        self.closed.set()


@pytest.fixture
def app():
    app = Flask(__name__)
    held_sessions.install(app)
    return app


def generated(session):
    """What a reply streams: whether its session was still open as each part went out."""
    for _ in range(2):
        yield {"closed_meanwhile": session.closes}


def sse_reply(session):
    held_sessions.hold(session)
    return event_stream(lambda cancelled: generated(session), lambda error: {"error": error.message})


def ndjson_reply(session):
    held_sessions.hold(session)
    return ndjson_stream(generated(session), lambda error: {"error": error.message})


def test_a_view_that_raises_closes_what_it_opened(app):
    session = FakeSession()

    @app.post("/fails")
    def fails():
        held_sessions.hold(session)
        raise RuntimeError("a later prompt failed")

    assert app.test_client().post("/fails").status_code == 500
    assert session.closes == 1


def test_a_reply_run_inside_the_view_is_closed_at_teardown(app):
    session = FakeSession()
    app.post("/whole")(lambda: held_sessions.hold(session) or "done")
    assert app.test_client().post("/whole").text == "done"
    assert session.closes == 1


@pytest.mark.parametrize("reply", [sse_reply, ndjson_reply])
def test_a_stream_read_to_its_end_closes_once(app, reply):
    session = FakeSession()
    app.post("/stream")(lambda: reply(session))
    response = app.test_client().post("/stream", buffered=False)
    body = b"".join(response.response)
    assert body.count(b'"closed_meanwhile": 0') == 2, body  # the request's teardown had handed it over
    response.close()
    assert session.closed.wait(5)
    assert session.closes == 1


@pytest.mark.parametrize("reply", [sse_reply, ndjson_reply])
def test_a_stream_never_read_closes_when_the_response_is_closed(app, reply):
    session = FakeSession()
    with app.test_request_context("/stream", method="POST"):
        response = reply(session)
    assert session.closes == 0  # the request's teardown ran: the stream holds the session now
    response.close()  # what gunicorn does when the client went away before the first write
    assert session.closes == 1


def test_outside_a_request_nothing_is_held():
    session = FakeSession()
    held_sessions.hold(session)  # a tool or a test calling the planning code directly closes its own
    held_sessions.hand_over()()
    assert session.closes == 0
