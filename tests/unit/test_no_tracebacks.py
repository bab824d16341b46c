"""Failures nobody planned for, where a reply is already under way: an SSE stream and a WebSocket connection say
one clean line (the log has the rest), and a WebSocket idle for too long is closed with a reason."""

import json
import logging
from types import SimpleNamespace

import pytest

from config import GatewaySettings, Limits, ModelConfig, Settings, SwarmSettings
from gateway import create_app
from gateway.web import request_ids
from gateway.errors import BadRequest, from_exception
from gateway.web.sse import event_stream
from gateway.petals.websocket import Connection
from swarm.protocol import CacheFullError, InternalServerError, MissingBlocksError, ServerUnavailableError

SECRET = "boom in /srv/gateway/secret.py"


@pytest.fixture
def app(tmp_path):
    gateway = GatewaySettings(models=(ModelConfig("m", "m"),))
    return create_app(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway))


def test_an_sse_stream_ends_with_a_clean_error_event_in_its_requests_context(app):
    def events(cancelled):
        yield {"request_id": request_ids.current.get()}
        raise RuntimeError(SECRET)

    with app.test_request_context("/v1/completions", headers={"X-Request-ID": "sse-1"}):
        app.preprocess_request()
        response = event_stream(events, lambda error: {"error": error.message})
    # gunicorn iterates the body after the request's teardown
    body = "".join(response.response)
    assert body.splitlines()[::2] == ['data: {"request_id": "sse-1"}',
                                      'data: {"error": "internal error (see the gateway\'s log)"}', "data: [DONE]"]
    assert "boom" not in body and ".py" not in body


class FakeSocket:
    """simple_websocket's side of a connection: scripted messages in (an exception is raised, running out is
    silence), frames and the close out."""

    def __init__(self, *incoming):
        self.incoming, self.frames, self.closed = list(incoming), [], None

    def receive(self, timeout=None):
        if not self.incoming:
            return None  # what simple_websocket returns when the timeout passes
        item = self.incoming.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def send(self, data):
        self.frames.append(json.loads(data))

    def close(self, reason=None, message=None):
        self.closed = (reason, message)


def failing_engine(error: Exception):
    def open_session(*args, **kwargs):
        raise error

    return SimpleNamespace(limits=Limits(ws_idle_timeout=7), open_session=open_session)


def serve(app, ws, engine):
    with app.test_request_context("/api/v2/generate"):
        Connection(ws, engine, client="ip:test").serve()


def test_a_message_that_fails_unexpectedly_gets_a_clean_frame_and_the_connection_goes_on(app):
    ws = FakeSocket(json.dumps({"type": "open_inference_session", "max_length": 8}), json.dumps({"type": "fly"}))
    serve(app, ws, failing_engine(RuntimeError(SECRET)))
    unexpected, next_one, idle = ws.frames
    assert unexpected["code"] == "internal_error" and unexpected["error"] == "internal error (see the gateway's log)"
    assert next_one["code"] == "invalid_request"  # the connection went on
    assert idle["code"] == "idle_timeout" and "7 s without a message (WS_IDLE_TIMEOUT)" in idle["error"]
    assert ws.closed == (1000, "idle timeout")
    assert "boom" not in json.dumps(ws.frames)


def test_a_clients_mistake_deep_in_the_engine_is_still_a_400(app):
    ws = FakeSocket(json.dumps({"type": "open_inference_session", "max_length": 8}))
    serve(app, ws, failing_engine(BadRequest("max_length: too long", field="max_length")))
    assert ws.frames[0] == {"ok": False, "error": "max_length: too long", "code": "invalid_request",
                            "traceback": "max_length: too long", "field": "max_length"}


def test_a_failure_outside_any_message_closes_with_1011_and_a_clean_reason(app):
    ws = FakeSocket(RuntimeError(SECRET))
    serve(app, ws, failing_engine(RuntimeError("unused")))
    assert ws.frames == [] and ws.closed == (1011, "internal error (see the gateway's log)")


PEER = "12D3KooWHostilePeerIdXyz"


@pytest.mark.parametrize("error, says", [
    (ServerUnavailableError(f"server {PEER} failed: ConnectionResetError(104, 'Connection reset by peer') "
                            "(blocks 0:2)"), "the swarm's servers for this model failed or did not answer"),
    (CacheFullError(f"every server that could serve blocks 0:4 of tiny has a full cache or failed (the last one: "
                    f"server {PEER} failed: P2PDaemonError('stream closed'))"), "has a full cache now"),
    (MissingBlocksError(f"no server holds blocks 0..14 of tiny; peer {PEER} says hi"),
     "no server holds some of this model's blocks now"),
    (InternalServerError(f"{PEER}: CUDA error in /srv/swarm/server/backend.py"), "the swarm failed to serve"),
])
def test_a_503_says_what_failed_and_only_the_log_has_peers_and_transports(error, says, caplog):
    with caplog.at_level("WARNING", logger="gateway.errors"):
        api_error = from_exception(error)
    assert api_error.status == 503 and says in api_error.message
    assert PEER not in api_error.message and "Error(" not in api_error.message and ".py" not in api_error.message
    [record] = caplog.records
    assert record.levelno == logging.WARNING and str(error) in record.getMessage() and record.exc_info is None
