"""Fuzzing the gateway through a real gunicorn in front of the tiny swarm.

- The HTTP APIs (Petals', OpenAI's with its Responses API, Ollama's: every route in docs.ROUTES), driven by the
  OpenAPI document the gateway serves, with schemathesis: valid and invalid bodies for every operation. No reply
  is a 5xx, none carries a traceback or a file path, every status is one the document lists, and every error body
  has the documented shape.
- The WebSocket API, with a seeded random mix of bytes, text, JSON, mutated valid messages, wrong types, messages
  out of order and oversized ones: each bad message gets an error frame or a clean close, the process never
  dies, and a valid request on a fresh connection succeeds afterwards.
- Nothing is left held: after every HTTP request (the sessions the fuzzer opens on purpose closed again) and every
  WebSocket connection, the gateway's open sessions and every block server's free cache are back where they
  started (tests/leak_checks.py); while a connection lives, it holds one session at most.

The gateway here generates at most a few tokens per request, so each of the hundreds of requests is quick.
FUZZ_SEED=N picks another WebSocket run; FUZZ_EXAMPLES=N more schemathesis examples per operation.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from dataclasses import asdict
from unittest.mock import ANY

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from config import Limits
from gunicorn_gateway import running_gateway
from shared_swarm import TINY_PREFIX
from leak_checks import Holdings

CONTEXT = 128  # the model's max_session_length
# a few tokens per request, so that hundreds of requests take seconds; no rate limit, room for many sessions
LIMITS = Limits(max_new_tokens=4, requests_per_minute=0, max_sessions=32, max_sessions_per_client=32,
                session_idle_timeout=2, ws_max_message_bytes=8192)
EXAMPLES_PER_OPERATION = int(os.environ.get("FUZZ_EXAMPLES", 15))
WS_SEED = int(os.environ.get("FUZZ_SEED", 8))
WS_MESSAGES = 200
LEAKS = ("Traceback", 'File "', "/site-packages/", "/work/", '.py", line')
tally = Counter()  # printed at the end (pytest -s): how much was sent, and what came back


@pytest.fixture(scope="module")
def fuzz_gateway(tiny_swarm, tiny_llama, tmp_path_factory):
    models = [{"name": "tiny", "path": str(tiny_llama), "dht_prefix": TINY_PREFIX, "max_session_length": CONTEXT}]
    env = {"INITIAL_PEERS": " ".join(tiny_swarm.initial_peers), "MODELS": json.dumps(models),
           "KEYLESS_SHARING": "1",  # saved states and MLC's stateful chat answer, rather than a 403, to be fuzzed
           **{name.upper(): str(value) for name, value in asdict(LIMITS).items()}}
    with running_gateway(env, tmp_path_factory.mktemp("fuzz-gateway")) as server:
        yield server
        print(f"\nfuzz tally: {dict(sorted(tally.items()))}")
        alive = server.process.poll() is None
    assert alive, "the gateway died"


@pytest.fixture(scope="module")
def holdings(fuzz_gateway, tiny_remote, tiny_swarm):
    return Holdings(fuzz_gateway, tiny_remote.client, tiny_swarm)


def no_leak(text: str) -> None:
    for leak in LEAKS:
        assert leak not in text, f"a reply leaks {leak!r}: {text[:500]}"


# ------------------------------------------------------------------------------------------ HTTP


def openapi_schema():
    """The document the gateway serves at /openapi.json (test_the_fuzzed_document_is_the_served_one), loaded at
    collection so that each operation is a test of its own; the requests go to the live gateway."""
    from gateway.docs import openapi_document

    config = schemathesis.Config.from_dict({
        "generation": {"mode": "all", "max-examples": EXAMPLES_PER_OPERATION},
        "phases": {"coverage": {"enabled": False}, "stateful": {"enabled": False}},
    })
    return schemathesis.openapi.from_dict(json.loads(json.dumps(openapi_document(LIMITS, CONTEXT))), config=config)


schema = openapi_schema()


def test_the_fuzzed_document_is_the_served_one(fuzz_gateway):
    assert requests.get(fuzz_gateway.url + "/openapi.json").json() == schema.raw_schema


def no_traceback_or_internal_path(ctx, response, case):
    tally["http requests"] += 1
    tally[f"http {response.status_code} {case.operation.label}"] += 1
    no_leak(response.text)


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=20_000, derandomize=not os.environ.get("FUZZ_RANDOM"),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
def test_http_apis_survive_fuzzing(case, fuzz_gateway, holdings):
    response = case.call_and_validate(base_url=fuzz_gateway.url, timeout=30, checks=[
        no_traceback_or_internal_path, not_a_server_error, status_code_conformance, response_schema_conformance])
    close_opened_session(fuzz_gateway, case, response)
    holdings.assert_back(f"{case.operation.label} answered {response.status_code} to {case.body!r:.300}")


def close_opened_session(gateway, case, response) -> None:
    """A session the fuzzer opened on purpose (open_inference_session) is the client's to close."""
    if case.operation.path == "/api/v1/open_inference_session" and response.status_code == 200:
        closed = requests.post(gateway.url + "/api/v1/close_inference_session",
                               json={"session_id": response.json()["session_id"]}, timeout=30)
        assert closed.status_code == 200, closed.text


# ------------------------------------------------------------------------------------------ WebSocket

OPEN = {"type": "open_inference_session", "max_length": 48}
VALID = [
    OPEN,
    {"type": "generate", "inputs": "Hello", "max_new_tokens": 2},
    {"type": "generate", "inputs": " more", "max_new_tokens": 1, "do_sample": True, "temperature": 0.7, "top_p": 0.9,
     "top_k": 5, "repetition_penalty": 1.1, "seed": 3},
    {"type": "generate", "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_new_tokens": 1,
     "max_reply_tokens": 2},
    {"type": "generate", "regenerate": True, "max_new_tokens": 1},
    {"type": "generate", "inputs": "x", "stop_sequence": "zz", "max_new_tokens": 2, "max_length": 40},
    {"type": "stop"},
    {"type": "close_inference_session"},
]
EXTREMES = [None, True, False, 0, -1, 1.5, -1e308, 1e308, 2**63, -(2**63), 10**30, "", "0.7", "x" * 300, "\u0000",
            "\ud7ff\ue000", [], [1, "a"], {}, {"type": "generate"}, [[[[]]]]]


def random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice(EXTREMES)
    if kind == 1:
        return rng.randint(-10**6, 10**6)
    if kind == 2:
        return rng.random() * rng.choice([1, 1e6, -1e-6])
    if kind == 3:
        return "".join(chr(rng.randrange(1, 0xD7FF)) for _ in range(rng.randrange(12)))
    if kind == 4:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["type", "inputs", "max_length", "max_new_tokens", "messages", "stream", "x"]):
            random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def mutated(rng: random.Random) -> dict:
    message = json.loads(json.dumps(rng.choice(VALID)))
    for _ in range(rng.randrange(1, 3)):
        key = rng.choice([*message, "type", "model", "session_id", "extra_stop_sequences", "inputs"])
        action = rng.randrange(3)
        if action == 0:
            message.pop(key, None)
        else:
            message[key] = rng.choice(EXTREMES) if action == 1 else random_json(rng)
    return message


def fuzz_message(rng: random.Random):
    """A raw frame to send (str or bytes)."""
    kind = rng.randrange(10)
    if kind == 0:
        return rng.randbytes(rng.randrange(200))
    if kind == 1:
        return "".join(chr(rng.randrange(1, 0xD7FF)) for _ in range(rng.randrange(200)))
    if kind == 2:
        return json.dumps(random_json(rng))
    if kind == 3:
        return "[" * 3000 + "]" * 3000  # deeper than Python's parser goes
    if kind == 4:
        return json.dumps(mutated(rng))[: rng.randrange(1, 60)]  # cut short
    if kind == 5 and rng.random() < 0.1:
        return json.dumps({"type": "generate", "inputs": "x" * LIMITS.ws_max_message_bytes})  # over the limit
    return json.dumps(rng.choice(VALID) if kind == 6 else mutated(rng))


def expects_a_reply(raw) -> bool:
    """Every message is answered but a stop with nothing to stop (a valid stop, so silently ignored)."""
    try:
        message = json.loads(raw)
    except (ValueError, RecursionError):
        return True
    return not (isinstance(message, dict) and message.get("type") == "stop")


def read_answer(ws) -> list[dict]:
    """The frames answering one message: up to an error, a plain {ok: true}, or a reply's last frame."""
    frames = []
    while True:
        raw = ws.recv(timeout=60)
        no_leak(raw)
        frame = json.loads(raw)
        assert isinstance(frame, dict) and isinstance(frame.get("ok"), bool), frame
        if not frame["ok"]:
            assert frame["error"] and frame["code"] and frame["traceback"] == frame["error"], frame
        frames.append(frame)
        if not frame["ok"] or "outputs" not in frame or frame["stop"]:
            return frames


def valid_request_succeeds(gateway) -> None:
    with connect(gateway.ws_url, open_timeout=30) as ws:
        ws.send(json.dumps(OPEN))
        assert read_answer(ws) == [{"ok": True, "session_id": ANY}]
        ws.send(json.dumps({"type": "generate", "inputs": "Hello", "max_new_tokens": 2}))
        assert read_answer(ws)[-1]["ok"]


def test_websocket_survives_fuzzing(fuzz_gateway, holdings):
    rng = random.Random(WS_SEED)
    sent, ws = 0, connect(fuzz_gateway.ws_url, open_timeout=30)
    try:
        while sent < WS_MESSAGES:
            raw = fuzz_message(rng)
            sent += 1
            tally["ws messages"] += 1
            try:
                ws.send(raw)
                if expects_a_reply(raw):
                    tally[f"ws {read_answer(ws)[-1].get('code', 'ok')}"] += 1
                    assert holdings.open_sessions() <= holdings.started_sessions + 1, f"after {raw[:200]!r}"
            except ConnectionClosed as closed:  # only for a message over the limit, and cleanly
                tally["ws closed: message too big"] += 1
                assert len(raw) > LIMITS.ws_max_message_bytes and closed.rcvd and closed.rcvd.code == 1009, (closed, raw[:200])
                assert fuzz_gateway.process.poll() is None
                holdings.assert_back("a WebSocket closed for a message over the limit")
                valid_request_succeeds(fuzz_gateway)
                ws = connect(fuzz_gateway.ws_url, open_timeout=30)
    finally:
        ws.close()
    assert fuzz_gateway.process.poll() is None
    holdings.assert_back("the fuzzed WebSocket's close")
    valid_request_succeeds(fuzz_gateway)
    holdings.assert_back("a valid WebSocket conversation")


def test_websocket_messages_out_of_order_and_interleaved(fuzz_gateway, holdings):
    with connect(fuzz_gateway.ws_url, open_timeout=30) as ws:
        for message in ({"type": "generate", "inputs": "x"}, {"type": "generate", "regenerate": True},
                        {"type": "close_inference_session"}):
            ws.send(json.dumps(message))
            [frame] = read_answer(ws)  # a generate before any session is an error; a close of none is fine
            assert frame["ok"] is (message["type"] == "close_inference_session")
        ws.send(json.dumps(OPEN))
        ws.send(json.dumps(OPEN))  # opening again starts over
        opened = [read_answer(ws), read_answer(ws)]
        assert opened == [[{"ok": True, "session_id": ANY}]] * 2 and opened[0] != opened[1]  # two sessions
        # a long reply with messages arriving meanwhile: a stop ends it, the others are answered in turn after it
        ws.send(json.dumps({"type": "generate", "inputs": "Go", "stream": True, "max_new_tokens": 1}))
        for raw in ("garbage", json.dumps({"type": "stop"}), json.dumps({"type": "fly"}), json.dumps(OPEN)):
            ws.send(raw)
        reply = read_answer(ws)
        assert reply[-1]["stop"] and reply[-1]["finish_reason"] in ("cancelled", "length", "stop")
        assert [frame["code"] for frame in read_answer(ws) + read_answer(ws)] == ["invalid_request", "invalid_request"]
        assert read_answer(ws) == [{"ok": True, "session_id": ANY}]
    assert requests.get(fuzz_gateway.url + "/health").status_code == 200
    holdings.assert_back("an interleaved WebSocket conversation")
