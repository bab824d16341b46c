"""Petals Chat's HTTP API through a real gunicorn in front of the tiny swarm, driven with `requests`."""

import threading
import time

import pytest
import requests
import torch
import transformers

from shared_gateways import TINY_IDLE_TIMEOUT, TINY_MAX_SESSIONS


@pytest.fixture(scope="module")
def local(tiny_llama):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    return model, tokenizer


def greedy_text(local, ids, count):
    model, tokenizer = local
    with torch.no_grad():
        output = model.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False)
    new = output[0, len(ids):].tolist()
    return tokenizer.decode([token for token in new if token != tokenizer.eos_token_id]), new


def api(gateway, path, method="post", **kwargs):
    response = getattr(requests, method)(gateway.url + path, timeout=60, **kwargs)
    assert "Traceback" not in response.text and "File \"" not in response.text
    return response


def test_health_and_models(gateway):
    health = api(gateway, "/health", "get")
    assert health.status_code == 200 and health.json()["covered"] is True
    models = api(gateway, "/api/v1/models", "get").json()
    assert models["ok"] and models["default_model"] == "tiny"
    tiny, *adapters = models["models"]  # the model, then its LoRA adapters (tests/e2e/test_adapters_api.py)
    assert [adapter["parent"] for adapter in adapters] == ["tiny"] * len(adapters) == ["tiny", "tiny"]
    assert tiny["covered"] and tiny["num_blocks"] == 4 and tiny["servers"] == 2 and tiny["missing_blocks"] is None


@pytest.mark.parametrize("how", ["json", "form", "query"])
def test_generate_equals_local_greedy(gateway, local, how):
    fields = {"inputs": "Hello, world!", "max_new_tokens": 7}
    sent = {"json": {"json": fields}, "form": {"data": fields}, "query": {"params": fields}}[how]
    reply = api(gateway, "/api/v1/generate", **sent)
    assert reply.status_code == 200, reply.text
    expected, tokens = greedy_text(local, local[1]("Hello, world!")["input_ids"], 7)
    assert reply.json() == {"ok": True, "outputs": expected, "token_count": len(tokens)}


def test_session_continues_without_resending(gateway, local, tiny_swarm):
    from swarm.client import SwarmClient

    client = SwarmClient(tiny_swarm.initial_peers)
    first_server = min(client.servers("tiny", 4), key=lambda server: server.info.start)
    served = lambda: client.server_info(first_server.peer_id)["positions_served"]
    tokenizer = local[1]
    try:
        session_id = api(gateway, "/api/v1/open_inference_session", json={"max_length": 64}).json()["session_id"]
        first = api(gateway, "/api/v1/generate", json={"inputs": "The quick", "max_new_tokens": 5,
                                                       "session_id": session_id}).json()
        before = served()
        second = api(gateway, "/api/v1/generate", json={"inputs": " brown fox", "max_new_tokens": 4,
                                                        "session_id": session_id}).json()
        more_ids = tokenizer(" brown fox", add_special_tokens=False)["input_ids"]
        # the previous reply's last token, the new text, then one token per step: nothing older travels
        assert served() - before == 1 + len(more_ids) + (4 - 1)

        first_ids = tokenizer("The quick")["input_ids"]
        _, first_tokens = greedy_text(local, first_ids, 5)
        expected, second_tokens = greedy_text(local, first_ids + first_tokens + more_ids, 4)
        assert first["outputs"] == greedy_text(local, first_ids, 5)[0] and second["outputs"] == expected

        continued = api(gateway, "/api/v1/generate", json={"max_new_tokens": 2, "session_id": session_id})
        after, _ = greedy_text(local, first_ids + first_tokens + more_ids + second_tokens, 2)
        assert continued.json() == {"ok": True, "outputs": after, "token_count": 2}  # no inputs: continue
        assert api(gateway, "/api/v1/close_inference_session", json={"session_id": session_id}).json() == {"ok": True}
    finally:
        client.shutdown()


def test_multi_token_stop_sequence(gateway, local):
    full = api(gateway, "/api/v1/generate", json={"inputs": "Numbers:", "max_new_tokens": 20}).json()["outputs"]
    tokenizer = local[1]
    # a stop sequence that spans a token boundary of the reply
    pieces = [tokenizer.decode([token]) for token in tokenizer(full, add_special_tokens=False)["input_ids"]]
    boundary = len(pieces[0]) + len(pieces[1])
    stop = full[boundary - 2 : boundary + 2]
    assert len(stop) == 4
    reply = api(gateway, "/api/v1/generate", json={"inputs": "Numbers:", "max_new_tokens": 20,
                                                   "stop_sequence": stop}).json()
    assert reply["outputs"] == full[: full.index(stop) + len(stop)]


def test_idle_sessions_expire_and_free_the_servers(gateway, tiny_swarm):
    from swarm.client import SwarmClient
    from swarm.protocol import PAGE_TOKENS

    session_id = api(gateway, "/api/v1/open_inference_session", json={"max_length": 100}).json()["session_id"]
    client = SwarmClient(tiny_swarm.initial_peers)
    try:
        peers = [server.peer_id for server in client.servers("tiny", 4)]
        free = lambda: [client.server_info(peer)["cache_tokens_free"] for peer in peers]
        busy = free()
        # wait, without touching the session, until the gateway has closed it: the servers get their page back
        deadline = time.monotonic() + TINY_IDLE_TIMEOUT + 60
        while time.monotonic() < deadline and any(after <= before for before, after in zip(busy, free())):
            time.sleep(0.2)
        reply = api(gateway, "/api/v1/generate", json={"inputs": "hi", "session_id": session_id})
        assert reply.status_code == 404 and "unknown inference session" in reply.json()["error"]
        freed = [client.server_info(peer)["cache_tokens_free"] for peer in peers]
        assert all(after == before + PAGE_TOKENS for before, after in zip(busy, freed))  # its one page
    finally:
        client.shutdown()


def test_session_cap(gateway):
    opened = []
    try:
        for _ in range(TINY_MAX_SESSIONS):
            reply = api(gateway, "/api/v1/open_inference_session", json={"max_length": 16})
            assert reply.status_code == 200
            opened.append(reply.json()["session_id"])
        refused = api(gateway, "/api/v1/open_inference_session", json={"max_length": 16})
        assert refused.status_code == 429 and refused.json()["code"] == "too_many_sessions"
        assert refused.headers["Retry-After"] == "1"
        assert api(gateway, "/api/v1/generate", json={"inputs": "hi", "max_new_tokens": 1}).status_code == 429
    finally:
        for session_id in opened:
            api(gateway, "/api/v1/close_inference_session", params={"session_id": session_id})
    assert api(gateway, "/api/v1/generate", json={"inputs": "hi", "max_new_tokens": 1}).json()["token_count"] == 1


def test_a_busy_session_refuses_a_second_request(gateway, tiny_swarm):
    from swarm.client import SwarmClient

    client = SwarmClient(tiny_swarm.initial_peers)
    last_server = max(client.servers("tiny", 4), key=lambda server: server.info.start).peer_id
    served = lambda: client.server_info(last_server)["positions_served"]
    session_id = api(gateway, "/api/v1/open_inference_session", json={"max_length": 250}).json()["session_id"]
    replies = []
    long_reply = threading.Thread(target=lambda: replies.append(api(gateway, "/api/v1/generate", json={
        "inputs": "go", "max_new_tokens": 200, "session_id": session_id})))
    before = served()
    long_reply.start()
    try:
        deadline = time.monotonic() + 60  # until its prompt has gone through every block: it holds the session
        while time.monotonic() < deadline and served() == before:
            time.sleep(0.01)
        second = api(gateway, "/api/v1/generate", json={"inputs": "x", "max_new_tokens": 1, "session_id": session_id})
        long_reply.join()
        assert second.status_code == 409 and second.json()["code"] == "session_busy"
        assert replies[0].json()["token_count"] == 200  # the first request went on undisturbed
    finally:
        long_reply.join()
        api(gateway, "/api/v1/close_inference_session", json={"session_id": session_id})
        client.shutdown()


@pytest.mark.parametrize(
    "path, kwargs, status, fragment",
    [
        ("/api/v1/generate", {"data": "{not json", "headers": {"Content-Type": "application/json"}}, 400, "not valid JSON"),
        ("/api/v1/generate", {"json": ["a list"]}, 400, "must be an object"),
        ("/api/v1/generate", {"json": {"inputs": "hi", "max_new_tokens": "many"}}, 400, "max_new_tokens"),
        ("/api/v1/generate", {"json": {"inputs": "hi", "max_new_tokens": -1}}, 400, "max_new_tokens"),
        ("/api/v1/generate", {"json": {"inputs": "hi", "max_new_tokens": 10**9}}, 400, "max_new_tokens: at most 200"),
        ("/api/v1/generate", {"json": {"inputs": "hi", "max_length": -5}}, 400, "max_length"),
        ("/api/v1/generate", {"json": {"inputs": "hi", "max_length": 10**9}}, 400, "max_length: at most 1024"),
        ("/api/v1/generate", {"json": {"inputs": 5}}, 400, "inputs"),
        ("/api/v1/generate", {"json": {"inputs": "hi", "temperature": "hot"}}, 400, "temperature"),
        ("/api/v1/generate", {"json": {"inputs": "hi", "top_p": 2}}, 400, "top_p"),
        ("/api/v1/generate", {"json": {"max_new_tokens": 3}}, 400, "inputs: required"),
        ("/api/v1/generate", {"json": {"inputs": "hi", "model": "gpt-9"}}, 404, "unknown model 'gpt-9'"),
        ("/api/v1/generate", {"json": {"inputs": "hi", "session_id": "no-such"}}, 404, "unknown inference session"),
        ("/api/v1/generate", {"json": {"inputs": "word " * 1000, "max_new_tokens": 1}}, 400, "maximum context length"),
        ("/api/v1/open_inference_session", {"json": {}}, 400, "max_length: Field required"),
        ("/api/v1/open_inference_session", {"json": {"max_length": 0}}, 400, "max_length"),
        ("/api/v1/open_inference_session", {"json": {"max_length": 100000}}, 400, "max_length: at most 1024"),
        ("/api/v1/open_inference_session", {"json": {"max_length": 8, "model": "nope"}}, 404, "unknown model"),
        ("/api/v1/close_inference_session", {"json": {}}, 400, "session_id"),
        ("/api/v1/close_inference_session", {"json": {"session_id": "nope"}}, 404, "unknown inference session"),
        ("/api/v1/nowhere", {}, 404, "not found"),
    ],
)
def test_bad_input_gets_a_clear_error(gateway, path, kwargs, status, fragment):
    reply = api(gateway, path, **kwargs)
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["ok"] is False and fragment.lower() in body["error"].lower()
    assert body["traceback"] == body["error"]


def test_generate_after_close_and_wrong_method(gateway):
    session_id = api(gateway, "/api/v1/open_inference_session", json={"max_length": 16}).json()["session_id"]
    api(gateway, "/api/v1/close_inference_session", json={"session_id": session_id})
    reply = api(gateway, "/api/v1/generate", json={"inputs": "hi", "session_id": session_id})
    assert reply.status_code == 404
    wrong = api(gateway, "/api/v1/generate", "get")
    assert wrong.status_code == 405 and wrong.json()["ok"] is False
    assert api(gateway, "/api/v1/generate", json={"inputs": "still serving", "max_new_tokens": 2}).json()["ok"] is True
