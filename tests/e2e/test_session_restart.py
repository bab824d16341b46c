"""Sessions outlive the gateway (SESSION_STORE): a real gunicorn in front of the shared tiny swarm, killed with
SIGKILL mid-conversation and started again on the same port and store, continues an HTTP session and a WebSocket
chat exactly as a session that was never interrupted does; a corrupt store stops the start with one clear line."""

from __future__ import annotations

import json

import pytest
import requests
from websockets.sync.client import connect

from gateway_log import assert_clean_log
from gunicorn_gateway import Gateway
from shared_swarm import TINY_PREFIX

TOKENS = 8  # each request's reply: greedy, so an exact continuation is the same text


@pytest.fixture(scope="module")
def gateway_env(tiny_swarm, tiny_llama, tmp_path_factory):
    models = [{"name": "tiny", "path": str(tiny_llama), "dht_prefix": TINY_PREFIX, "max_session_length": 512}]
    store = tmp_path_factory.mktemp("store") / "sessions.sqlite3"
    return {"INITIAL_PEERS": " ".join(tiny_swarm.initial_peers), "MODELS": json.dumps(models),
            "SESSION_STORE": str(store)}


def http_turn(gateway, session_id: str, inputs: str) -> str:
    reply = requests.post(gateway.url + "/api/v1/generate", timeout=60,
                          json={"session_id": session_id, "inputs": inputs, "max_new_tokens": TOKENS}).json()
    assert reply["ok"] and reply["token_count"] == TOKENS, reply
    return reply["outputs"]


def http_open(gateway) -> str:
    opened = requests.post(gateway.url + "/api/v1/open_inference_session", json={"max_length": 256}, timeout=60)
    return opened.json()["session_id"]


def ws_call(ws, **message) -> list[dict]:
    """A message's frames, up to the last of its reply."""
    ws.send(json.dumps(message))
    frames = [json.loads(ws.recv(timeout=60))]
    while frames[-1].get("ok") and "outputs" in frames[-1] and not frames[-1]["stop"]:
        frames.append(json.loads(ws.recv(timeout=60)))
    assert frames[-1]["ok"], frames[-1]
    return frames


def chat_turn(ws, content: str, **fields) -> str:
    frames = ws_call(ws, type="generate", messages=[{"role": "user", "content": content}] if content else None,
                     stream=True, max_new_tokens=1, max_reply_tokens=TOKENS, **fields)
    return "".join(frame["outputs"] for frame in frames)


def ws_open(ws, **fields) -> str:
    [opened] = ws_call(ws, type="open_inference_session", **fields)
    return opened["session_id"]


def test_a_gateway_killed_and_restarted_continues_http_and_websocket_sessions_exactly(gateway_env, tmp_path):
    first = Gateway(gateway_env, tmp_path / "first.log")
    try:
        http_session = http_open(first)
        http_before = http_turn(first, http_session, "Once upon a time")
        with connect(first.ws_url) as ws:
            chat_session = ws_open(ws, max_length=256)
            chat_before = [chat_turn(ws, "Hello!"), chat_turn(ws, "Tell me more")]
            first.kill()  # mid-conversation, the WebSocket still open: nothing is closed or saved on the way out
    finally:
        if first.process.poll() is None:  # the test failed before the kill
            first.kill()
    assert_clean_log(first.log())

    second = Gateway(gateway_env, tmp_path / "second.log", port=first.port)
    try:
        http_after = http_turn(second, http_session, " and then")
        with connect(second.ws_url) as ws:
            assert ws_open(ws, session_id=chat_session) == chat_session
            # the last reply again (where it began is stored), then a new turn over the stored transcript
            chat_after = [chat_turn(ws, "", regenerate=True), chat_turn(ws, "And then?")]

        # the same conversations on a gateway that was never killed (the restarted one, in fresh sessions)
        reference = http_open(second)
        assert [http_turn(second, reference, "Once upon a time"), http_turn(second, reference, " and then")] == \
               [http_before, http_after]
        with connect(second.ws_url) as ws:
            ws_open(ws, max_length=256)
            assert [chat_turn(ws, "Hello!"), chat_turn(ws, "Tell me more")] == chat_before
            assert [chat_turn(ws, "", regenerate=True), chat_turn(ws, "And then?")] == chat_after
        assert chat_after[0] == chat_before[1]  # greedy: the regenerated reply is the same
        assert requests.post(second.url + "/api/v1/close_inference_session", json={"session_id": http_session},
                             timeout=30).json() == {"ok": True}
        assert requests.post(second.url + "/api/v1/generate", json={"session_id": http_session, "inputs": "x"},
                             timeout=30).status_code == 404  # closed for good, in the store too
    finally:
        second.stop()
    assert_clean_log(second.log())
    assert "reopened inference session" in second.log()


def test_a_corrupt_store_stops_the_start_with_one_clear_line(gateway_env, tmp_path):
    store = tmp_path / "sessions.sqlite3"
    store.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 16)
    with pytest.raises(RuntimeError, match="gunicorn exited") as failed:
        Gateway({**gateway_env, "SESSION_STORE": str(store)}, tmp_path / "gunicorn.log")
    log = (tmp_path / "gunicorn.log").read_text()
    assert f"error: SESSION_STORE={store}: cannot use the session store" in log
    assert "Traceback" not in log and "App failed to load" in log
    assert store.read_bytes().startswith(b"SQLite format 3\x00" + bytes(range(256)))  # left as it was
