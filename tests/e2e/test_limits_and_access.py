"""The gateway's limits, keys and origin checks, through a real gunicorn in front of the tiny swarm, configured
tight (conftest.strict_gateway): small limits, API keys and an origin allowlist. Each test spends the allowance of
a key of its own, since the per-client limits count by key."""

import base64
import json
import os
import socket
import time
from urllib.parse import urlsplit
from unittest.mock import ANY

import openai
import pytest
import requests
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from shared_gateways import STRICT_CONTEXT as CONTEXT
from shared_gateways import STRICT_LIMITS as LIMITS
from shared_gateways import STRICT_ORIGIN as ALLOWED_ORIGIN


@pytest.fixture(scope="module")
def strict(strict_gateway):
    return strict_gateway


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def post(strict, path, key, **kwargs):
    reply = requests.post(strict.url + path, headers={**bearer(key), **kwargs.pop("headers", {})}, timeout=60,
                          **kwargs)
    assert "Traceback" not in reply.text and 'File "' not in reply.text
    return reply


def ws_connect(strict, key=None, **kwargs):
    url = strict.ws_url + (f"?api_key={key}" if key else "")
    return connect(url, open_timeout=30, **kwargs)


def ws_call(ws, **message) -> dict:
    ws.send(json.dumps(message))
    return json.loads(ws.recv(timeout=30))


def handshake_status(strict, **kwargs) -> int:
    with pytest.raises(InvalidStatus) as refused:
        with ws_connect(strict, **kwargs):
            pass
    return refused.value.response.status_code


# ------------------------------------------------------------------------------------------ keys and origins


def test_every_api_needs_a_key_and_health_stays_open(strict):
    assert requests.get(strict.url + "/health").status_code == 200
    assert requests.get(strict.url + "/").status_code == 200  # the chat page asks for the key itself
    refused = requests.post(strict.url + "/api/v1/generate", json={"inputs": "hi", "max_new_tokens": 1})
    assert refused.status_code == 401 and refused.json()["code"] == "invalid_api_key"
    assert requests.get(strict.url + "/api/v1/models").status_code == 401
    assert requests.get(strict.url + "/metrics").status_code == 401
    assert post(strict, "/api/v1/generate", "key-access", json={"inputs": "hi", "max_new_tokens": 1}).status_code == 200
    assert requests.post(strict.url + "/api/v1/generate", json={"inputs": "hi", "max_new_tokens": 1},
                         headers={"X-API-Key": "key-access"}).status_code == 200

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=strict.url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=strict.url + "/v1", api_key="key-access", max_retries=0)
    assert good.models.list().data[0].id == "tiny"

    assert handshake_status(strict) == 401
    assert handshake_status(strict, key="wrong") == 401
    with ws_connect(strict, key="key-access") as ws:  # a browser's way: ?api_key=
        assert ws_call(ws, type="open_inference_session", max_length=16) == {"ok": True, "session_id": ANY}
    with ws_connect(strict, additional_headers=bearer("key-access")) as ws:  # any other client's
        assert ws_call(ws, type="open_inference_session", max_length=16) == {"ok": True, "session_id": ANY}


def test_websocket_handshakes_follow_the_origin_allowlist(strict):
    assert handshake_status(strict, key="key-access", origin="https://evil.example") == 403
    for origin in (ALLOWED_ORIGIN, strict.url):  # the allowlist, and the gateway's own chat page
        with ws_connect(strict, key="key-access", origin=origin) as ws:
            assert ws_call(ws, type="open_inference_session", max_length=16) == {"ok": True, "session_id": ANY}
    preflight = requests.options(strict.url + "/v1/chat/completions",
                                 headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "Access-Control-Allow-Origin" not in preflight.headers


# ------------------------------------------------------------------------------------------ request limits


def test_a_body_over_max_body_bytes_is_413(strict):
    big = {"inputs": "x" * 9000, "max_new_tokens": 1}
    petals = post(strict, "/api/v1/generate", "key-body", json=big)
    assert petals.status_code == 413 and petals.json()["code"] == "request_too_large"
    assert "limit of 8192 bytes (MAX_BODY_BYTES)" in petals.json()["error"]
    chat = post(strict, "/v1/chat/completions", "key-body", json={"messages": [{"role": "user", "content": "x" * 9000}]})
    assert chat.status_code == 413 and chat.json()["error"]["code"] == "request_too_large"
    chunked = post(strict, "/api/v1/generate", "key-body", data=(b"x" * 1000 for _ in range(10)),
                   headers={"Content-Type": "application/json"})  # no Content-Length: found while reading
    assert chunked.status_code == 413 and "MAX_BODY_BYTES" in chunked.json()["error"]


def test_prompts_longer_than_the_context_are_context_length_exceeded_in_every_api(strict):
    long_text = "word " * CONTEXT
    chat = post(strict, "/v1/chat/completions", "key-context", json={"messages": [{"role": "user", "content": long_text}]})
    # a prompt that fits, but not with the completion asked for
    completion = post(strict, "/v1/completions", "key-context", json={"prompt": [5] * (CONTEXT - 8), "max_tokens": 16})
    embedding = post(strict, "/v1/embeddings", "key-context", json={"input": long_text})
    for reply, param in ((chat, "messages"), (completion, "prompt"), (embedding, "input")):
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == param
        assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    petals = post(strict, "/api/v1/generate", "key-context", json={"inputs": long_text, "max_new_tokens": 1})
    assert petals.status_code == 400 and petals.json()["code"] == "context_length_exceeded"
    with ws_connect(strict, key="key-context") as ws:
        assert ws_call(ws, type="open_inference_session", max_length=CONTEXT)["ok"]
        frame = ws_call(ws, type="generate", inputs=long_text, max_new_tokens=1)
        assert frame["ok"] is False and frame["code"] == "context_length_exceeded"


def test_caps_name_their_setting(strict):
    reply = post(strict, "/v1/completions", "key-context", json={"prompt": "hi", "max_tokens": 17})
    assert reply.status_code == 400 and "at most 16, got 17 (MAX_NEW_TOKENS)" in reply.json()["error"]["message"]
    # each prompt of a completion holds a session while it runs: more than a client may hold is a bad request
    reply = post(strict, "/v1/completions", "key-context", json={"prompt": ["a", "b", "c"], "max_tokens": 1})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "prompt" and "MAX_SESSIONS_PER_CLIENT" in error["message"]


def test_requests_per_minute_per_client(strict):
    spend = lambda key: post(strict, "/v1/chat/completions", key, json={})  # a cheap 400; it counts all the same
    statuses = [spend("key-rate").status_code for _ in range(LIMITS["REQUESTS_PER_MINUTE"] + 3)]
    assert statuses.count(400) in range(40, 43) and statuses[-1] == 429  # 40 at once, plus what refilled meanwhile
    refused = spend("key-rate")
    assert refused.json()["error"]["code"] == "rate_limited" and refused.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(refused.headers["Retry-After"]) <= 2  # one request's worth: 1.5 s at 40 a minute
    assert "REQUESTS_PER_MINUTE" in refused.json()["error"]["message"]
    assert spend("key-other").status_code == 400  # another client is not held back
    assert handshake_status(strict, key="key-rate") == 429
    time.sleep(int(refused.headers["Retry-After"]))
    assert spend("key-rate").status_code == 400


def test_websocket_messages_count_too_and_the_connection_stays(strict):
    with ws_connect(strict, key="key-ws-rate") as ws:
        answered = 0
        while (frame := ws_call(ws, type="fly"))["code"] != "rate_limited":
            answered += 1
            assert answered <= 45, "never limited"
        assert answered in range(39, 43)  # the handshake took one
        assert "REQUESTS_PER_MINUTE" in frame["error"]
        time.sleep(1.6)  # one request's worth: 1.5 s at 40 a minute (and less than WS_IDLE_TIMEOUT)
        assert ws_call(ws, type="open_inference_session", max_length=16) == {"ok": True, "session_id": ANY}


# ------------------------------------------------------------------------------------------ sessions


def test_open_sessions_per_client(strict):
    opened = [post(strict, "/api/v1/open_inference_session", "key-sessions", json={"max_length": 16}).json()
              for _ in range(2)]
    assert all(reply["ok"] for reply in opened)
    refused = post(strict, "/api/v1/open_inference_session", "key-sessions", json={"max_length": 16})
    assert refused.status_code == 429 and refused.json()["code"] == "too_many_sessions"
    assert refused.headers["Retry-After"] == "1" and "MAX_SESSIONS_PER_CLIENT" in refused.json()["error"]
    with ws_connect(strict, key="key-sessions") as ws:  # the WebSocket's sessions count for the same client
        frame = ws_call(ws, type="open_inference_session", max_length=16)
        assert frame["ok"] is False and frame["code"] == "too_many_sessions"
        other = post(strict, "/api/v1/open_inference_session", "key-other", json={"max_length": 16})
        assert other.status_code == 200  # another client is not held back
        post(strict, "/api/v1/close_inference_session", "key-other", json={"session_id": other.json()["session_id"]})
        post(strict, "/api/v1/close_inference_session", "key-sessions", json={"session_id": opened[0]["session_id"]})
        assert ws_call(ws, type="open_inference_session", max_length=16) == {"ok": True, "session_id": ANY}
    post(strict, "/api/v1/close_inference_session", "key-sessions", json={"session_id": opened[1]["session_id"]})


def open_sessions(strict) -> int:
    return requests.get(strict.url + "/health").json()["open_sessions"]


def test_an_idle_websocket_is_closed_with_a_reason_and_frees_its_session(strict):
    with ws_connect(strict, key="key-ws") as ws:
        assert ws_call(ws, type="open_inference_session", max_length=16) == {"ok": True, "session_id": ANY}
        for _ in range(2):  # each message restarts the clock: idle for 2 s at most, 4 s in all
            time.sleep(LIMITS["WS_IDLE_TIMEOUT"] - 1)
            assert ws_call(ws, type="generate", inputs="hi", max_new_tokens=1)["ok"]
        assert open_sessions(strict) == 1
        started = time.monotonic()
        frame = json.loads(ws.recv(timeout=10))
        assert frame["ok"] is False and frame["code"] == "idle_timeout" and "WS_IDLE_TIMEOUT" in frame["error"]
        assert 2.5 < time.monotonic() - started < 6
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd.code == 1000 and closed.value.rcvd.reason == "idle timeout"
    assert open_sessions(strict) == 0


def test_clients_that_never_finish_closing_hold_back_no_one(strict):
    """Idle WebSockets closed by the gateway whose clients never answer the close nor hang up: each connection waits
    for its client in its own thread. (gunicorn's one main thread used to wait up to 2 s for each, one after
    another, accepting nothing meanwhile: six such clients held /health for seconds.)"""
    sockets = [silent_websocket(strict, "key-silent") for _ in range(6)]
    try:
        time.sleep(LIMITS["WS_IDLE_TIMEOUT"] - 0.5)  # the gateway closes them all at once, half a second from now
        latencies = []
        while len(latencies) < 30:
            began = time.monotonic()
            assert requests.get(strict.url + "/health", timeout=60).status_code == 200
            latencies.append(time.monotonic() - began)
            time.sleep(0.1)
    finally:
        for sock in sockets:
            sock.close()
    assert max(latencies) < 2, latencies


def silent_websocket(strict, key: str) -> socket.socket:
    """A WebSocket client that, once the handshake is done, never reads, answers or closes anything."""
    address = urlsplit(strict.url)
    sock = socket.create_connection((address.hostname, address.port), timeout=30)
    handshake = (f"GET /api/v2/generate?api_key={key} HTTP/1.1\r\nHost: {address.netloc}\r\nUpgrade: websocket\r\n"
                 f"Connection: Upgrade\r\nSec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
                 "Sec-WebSocket-Version: 13\r\n\r\n")
    sock.sendall(handshake.encode())
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 101"), reply
    return sock


def test_a_websocket_message_over_the_limit_closes_with_1009(strict):
    with ws_connect(strict, key="key-ws") as ws:
        ws.send(json.dumps({"type": "generate", "inputs": "x" * 5000}))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd.code == 1009
    with ws_connect(strict, key="key-ws") as ws:  # the gateway goes on
        assert ws_call(ws, type="open_inference_session", max_length=16) == {"ok": True, "session_id": ANY}


# ------------------------------------------------------------------------------------------ logs


def test_request_ids_reach_the_log_and_prompts_do_not(strict):
    secret = "SECRET-PROMPT-7Q"
    reply = post(strict, "/api/v1/generate", "key-logs", json={"inputs": secret, "max_new_tokens": 1},
                 headers={"X-Request-ID": "e2e-req-1"})
    assert reply.status_code == 200 and reply.headers["X-Request-ID"] == "e2e-req-1"
    assert len(post(strict, "/api/v1/generate", "key-logs", json={}).headers["X-Request-ID"]) == 32
    chat = post(strict, "/v1/chat/completions", "key-logs", headers={"X-Request-ID": "e2e-req-2"},
                json={"messages": [{"role": "user", "content": secret}], "max_tokens": 1, "zz_unknown_field": 1})
    assert chat.status_code == 200
    deadline = time.monotonic() + 5
    while "zz_unknown_field" not in strict.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    [line] = [line for line in strict.log().splitlines() if "zz_unknown_field" in line]
    assert "INFO" in line and "[e2e-req-2]" in line
    assert secret not in strict.log()


# ------------------------------------------------------------------------------------------ work without a session


def test_inputs_and_their_tokens_are_capped_per_request(strict):
    """Each input of an embeddings or chooses request is a forward through the whole swarm: their number and their
    tokens are capped per request, before any runs (MAX_INPUTS_PER_REQUEST 4, MAX_INPUT_TOKENS_PER_REQUEST 100)."""
    five = ["a", "b", "c", "d", "e"]
    over = "at most 4 inputs in one request, got 5 (MAX_INPUTS_PER_REQUEST)"
    for path, body, field in (("/v1/embeddings", {"input": five}, "input"),
                              ("/v1/embeddings", {"input": [[5]] * 5}, "input"),
                              ("/v1/chooses", {"input": "x", "choices": five}, "choices")):
        reply = post(strict, path, "key-work", json=body)
        error = reply.json()["error"]
        assert (reply.status_code, error["param"]) == (400, field) and over in error["message"], (path, error)
    ollama = post(strict, "/api/embed", "key-work", json={"input": five})
    assert ollama.status_code == 400 and ollama.json()["error"] == "input: " + over

    tokens = post(strict, "/v1/embeddings", "key-work", json={"input": [[5] * 60, [5] * 60]})
    error = tokens.json()["error"]
    assert tokens.status_code == 400 and error["param"] == "input"
    assert "at most 100 tokens in one request, all inputs together, got 120 (MAX_INPUT_TOKENS_PER_REQUEST)" \
        in error["message"]
    assert post(strict, "/v1/embeddings", "key-work", json={"input": five[:4]}).status_code == 200


def test_embeddings_and_chooses_count_against_the_clients_sessions(strict):
    """A request without a session still holds a gateway thread for all its forwards: it takes one of the client's
    session slots while it runs, so a client at MAX_SESSIONS_PER_CLIENT (2) can start no more work of any kind."""
    opened = [post(strict, "/api/v1/open_inference_session", "key-work-slots", json={"max_length": 16}).json()
              for _ in range(2)]
    assert all(reply["ok"] for reply in opened)
    try:
        for path, body in (("/v1/embeddings", {"input": "hi"}), ("/v1/chooses", {"input": "x", "choices": ["a"]}),
                           ("/api/embed", {"input": "hi"}), ("/api/embeddings", {"prompt": "hi"})):
            refused = post(strict, path, "key-work-slots", json=body)
            assert refused.status_code == 429 and "MAX_SESSIONS_PER_CLIENT" in refused.text, (path, refused.text)
        assert post(strict, "/v1/embeddings", "key-other", json={"input": "hi"}).status_code == 200
    finally:
        for reply in opened:
            post(strict, "/api/v1/close_inference_session", "key-work-slots", json={"session_id": reply["session_id"]})
    assert post(strict, "/v1/embeddings", "key-work-slots", json={"input": "hi"}).status_code == 200


# ------------------------------------------------------------------------------------------ what one key owns


def test_one_client_storing_responses_evicts_only_its_own(strict):
    """MAX_STORED_RESPONSES is 4: a client storing more makes room from its own records, not from another's."""
    def respond(key, **fields):
        return post(strict, "/v1/responses", key, json={"input": "hi", "max_output_tokens": 1, **fields})

    kept = respond("key-store-a").json()["id"]
    ids = [respond("key-store-b").json()["id"] for _ in range(6)]
    assert requests.get(f"{strict.url}/v1/responses/{kept}", headers=bearer("key-store-a")).status_code == 200
    statuses = [requests.get(f"{strict.url}/v1/responses/{id_}", headers=bearer("key-store-b")).status_code
                for id_ in ids]
    assert statuses == [404] * 3 + [200] * 3

    refused = respond("key-store-a", metadata={f"k{index}": "v" for index in range(17)})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "metadata"
    assert "at most 16 key-value pairs" in refused.json()["error"]["message"]


def test_a_petals_http_session_is_its_openers_alone(strict):
    """With keys, another key gets the 404 of an unknown session: it can neither generate in it nor close it."""
    opened = post(strict, "/api/v1/open_inference_session", "key-owner-a", json={"max_length": 16}).json()
    session = {"session_id": opened["session_id"]}
    for path, body in (("/api/v1/generate", {**session, "inputs": "hi", "max_new_tokens": 1}),
                       ("/api/v1/close_inference_session", session)):
        refused = post(strict, path, "key-owner-b", json=body)
        assert refused.status_code == 404 and refused.json()["code"] == "not_found", refused.text
        assert "unknown inference session" in refused.json()["error"]
    mine = post(strict, "/api/v1/generate", "key-owner-a", json={**session, "inputs": "hi", "max_new_tokens": 1})
    assert mine.json()["ok"]
    assert post(strict, "/api/v1/close_inference_session", "key-owner-a", json=session).json() == {"ok": True}
