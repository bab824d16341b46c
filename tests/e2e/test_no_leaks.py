"""No request leaves a session behind, through a real gunicorn in front of the tiny swarm: the gateway's open
sessions (/metrics) and every block server's free cache (rpc_info) come back to where they started after requests
that fail part-way (a later prompt refused, a limit reached) and after clients that leave mid-stream, in every API
that streams. Before this was so, each such request kept a session open for good: MAX_SESSIONS_PER_CLIENT of them
locked the client out until the gateway restarted."""

from __future__ import annotations

import json
from unittest.mock import ANY

import pytest
import requests
from websockets.sync.client import connect

from gunicorn_gateway import running_gateway
from shared_swarm import TINY_PREFIX
from leak_checks import Holdings

CONTEXT = 128
PER_CLIENT = 3  # MAX_SESSIONS_PER_CLIENT: a few leaked sessions would lock this client out
OK_IDS = [5, 6, 7]


@pytest.fixture(scope="module")
def leak_gateway(tiny_swarm, tiny_llama, tmp_path_factory):
    models = [{"name": "tiny", "path": str(tiny_llama), "dht_prefix": TINY_PREFIX, "max_session_length": CONTEXT}]
    env = {"INITIAL_PEERS": " ".join(tiny_swarm.initial_peers), "MODELS": json.dumps(models),
           "MAX_SESSIONS_PER_CLIENT": str(PER_CLIENT), "REQUESTS_PER_MINUTE": "0", "MAX_NEW_TOKENS": "64"}
    with running_gateway(env, tmp_path_factory.mktemp("leak-gateway")) as server:
        yield server


@pytest.fixture
def holdings(leak_gateway, tiny_remote, tiny_swarm):
    holdings = Holdings(leak_gateway, tiny_remote.client, tiny_swarm)
    yield holdings
    holdings.assert_back()


def completion(gateway, prompt, **fields) -> requests.Response:
    return requests.post(gateway.url + "/v1/completions", timeout=60,
                         json={"model": "tiny", "prompt": prompt, "max_tokens": 2, **fields})


@pytest.mark.parametrize("later_prompt, status", [
    ([1] * (CONTEXT + 1), 400),  # too long for the context
    ([], 400),  # no tokens at all
])
def test_a_refused_later_prompt_closes_the_sessions_of_the_earlier_ones(leak_gateway, holdings, later_prompt, status):
    for _ in range(PER_CLIENT + 2):  # more than a client may hold at once
        refused = completion(leak_gateway, [OK_IDS, later_prompt])
        assert refused.status_code == status, refused.text
        holdings.assert_back("a refused completion")
    refused = completion(leak_gateway, ["ok", "x" * 4 * CONTEXT])  # text prompts: the same
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    assert completion(leak_gateway, ["ok", "fine"]).status_code == 200  # the client may still open sessions
    with connect(leak_gateway.ws_url, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "open_inference_session", "max_length": 16}))
        assert json.loads(ws.recv(timeout=30)) == {"ok": True, "session_id": ANY}


def test_a_later_prompt_over_the_session_cap_closes_the_earlier_ones(leak_gateway, holdings):
    held = requests.post(leak_gateway.url + "/api/v1/open_inference_session", json={"max_length": 16}).json()
    try:
        for _ in range(PER_CLIENT + 2):
            refused = completion(leak_gateway, [OK_IDS] * PER_CLIENT)  # one session too many with the held one
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_sessions"
    finally:
        requests.post(leak_gateway.url + "/api/v1/close_inference_session", json={"session_id": held["session_id"]})
    assert completion(leak_gateway, [OK_IDS] * PER_CLIENT).status_code == 200


# every streaming route, asked for a long reply that the client walks away from after its first line
STREAMS = {
    "openai completions, several prompts": ("/v1/completions", {"prompt": [OK_IDS] * PER_CLIENT, "max_tokens": 64}),
    "openai chat, n choices": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                                        "max_tokens": 64}),
    "anthropic": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 64, "store": False}),
    "ollama chat": ("/api/chat", {"messages": [{"role": "user", "content": "hi"}],
                                  "options": {"num_predict": 64, "temperature": 0}}),
    "ollama generate": ("/api/generate", {"prompt": "hi", "options": {"num_predict": 64, "temperature": 0}}),
}


@pytest.mark.parametrize("route, body", STREAMS.values(), ids=STREAMS.keys())
def test_a_client_leaving_mid_stream_leaves_nothing_open(leak_gateway, holdings, route, body):
    for _ in range(PER_CLIENT + 1):
        with requests.post(leak_gateway.url + route, json={"model": "tiny", "stream": True, **body}, stream=True,
                           timeout=60) as reply:
            assert reply.status_code == 200, reply.text
            next(line for line in reply.iter_lines() if line)  # the first event, then the connection is dropped
        holdings.assert_back(f"a stream of {route} cut short")


def test_a_client_leaving_before_reading_anything_leaves_nothing_open(leak_gateway, holdings):
    for route, body in STREAMS.values():
        reply = requests.post(leak_gateway.url + route, json={"model": "tiny", "stream": True, **body}, stream=True,
                              timeout=60)
        reply.close()  # the status line may have come; nothing of the body was read
    holdings.assert_back("streams never read")


def test_a_websocket_dropped_mid_reply_leaves_nothing_open(leak_gateway, holdings):
    for _ in range(PER_CLIENT + 1):
        ws = connect(leak_gateway.ws_url, open_timeout=30)
        ws.send(json.dumps({"type": "open_inference_session", "max_length": CONTEXT}))
        assert json.loads(ws.recv(timeout=30)) == {"ok": True, "session_id": ANY}
        ws.send(json.dumps({"type": "generate", "inputs": "hi", "stream": True, "max_new_tokens": 1}))
        assert json.loads(ws.recv(timeout=30))["ok"]
        ws.socket.close()  # no close frame: the connection just ends
        holdings.assert_back("a WebSocket dropped mid-reply")


ONE_REPLY = {name: STREAMS[name] for name in ("anthropic", "responses", "ollama chat", "ollama generate")}


def aborted_replies(gateway) -> float:
    text = requests.get(gateway.url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("gateway_aborted_replies_total{"))


@pytest.mark.parametrize("route, body", ONE_REPLY.values(), ids=ONE_REPLY.keys())
def test_a_client_leaving_mid_stream_aborts_its_reply_exactly_once(leak_gateway, holdings, route, body):
    before = aborted_replies(leak_gateway)
    with requests.post(leak_gateway.url + route, json={"model": "tiny", "stream": True, **body}, stream=True,
                       timeout=60) as reply:
        next(line for line in reply.iter_lines() if line)
    holdings.assert_back(f"a stream of {route} cut short")
    assert aborted_replies(leak_gateway) == before + 1


def test_a_websocket_dropped_mid_reply_aborts_it_exactly_once(leak_gateway, holdings):
    before = aborted_replies(leak_gateway)
    ws = connect(leak_gateway.ws_url, open_timeout=30)
    ws.send(json.dumps({"type": "open_inference_session", "max_length": CONTEXT}))
    assert json.loads(ws.recv(timeout=30))["ok"]
    ws.send(json.dumps({"type": "generate", "inputs": "hi", "stream": True, "max_new_tokens": 1}))
    assert json.loads(ws.recv(timeout=30))["ok"]
    ws.socket.close()
    holdings.assert_back("a WebSocket dropped mid-reply")
    assert aborted_replies(leak_gateway) == before + 1
