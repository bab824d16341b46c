"""Through real gunicorn: while no server holds some of a model's blocks (the only server of a span stopped, a
new one starting), a streamed WebSocket reply says it waits in an empty-output frame, a new HTTP request just
waits, the metrics show both waiting, and both replies then equal the no-gap reply."""

import json
import threading
import time
from unittest.mock import ANY

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from gunicorn_gateway import running_gateway

PREFIX = "gap-ws"
BLOCK_WAIT = 300
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def spans(tiny_swarm):
    """The model's two spans, one server each: {"first": ..., "second": ...} (a test may replace the second)."""
    servers = {name: tiny_swarm.add_server(["--blocks", blocks, "--dht-prefix", PREFIX], wait=False)
               for name, blocks in (("first", "0:2"), ("second", "2:4"))}
    for server in servers.values():
        server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), 180)
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="module")
def gap_gateway(tiny_swarm, tiny_llama, spans, tmp_path_factory):
    models = [{"name": "gap", "path": str(tiny_llama), "dht_prefix": PREFIX, "max_session_length": 256}]
    env = {"INITIAL_PEERS": " ".join(tiny_swarm.initial_peers), "MODELS": json.dumps(models),
           "BLOCK_WAIT_SECONDS": str(BLOCK_WAIT), "LOG_LEVEL": "INFO"}
    with running_gateway(env, tmp_path_factory.mktemp("gap-gateway")) as server:
        yield server


def metric(gateway, name: str, **labels) -> float:
    text = requests.get(gateway.url + "/metrics", timeout=30).text
    return next(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == name and sample.labels == labels)


def http_generate(gateway) -> dict:
    return requests.post(gateway.url + "/api/v1/generate", timeout=BLOCK_WAIT,
                         json={"model": "gap", "inputs": "Hello", "max_new_tokens": NEW_TOKENS}).json()


def test_a_gap_is_waited_out_and_a_streamed_reply_says_so(tiny_swarm, spans, gap_gateway):
    expected = http_generate(gap_gateway)["outputs"]
    served = metric(gap_gateway, "swarm_client_block_waits_total", outcome="served")
    with connect(gap_gateway.ws_url) as ws:
        ws.send(json.dumps({"type": "open_inference_session", "model": "gap", "max_length": 64}))
        assert json.loads(ws.recv(timeout=60)) == {"ok": True, "session_id": ANY}
        spans.pop("second").stop()  # the only server of blocks 2..3 leaves
        ws.send(json.dumps({"type": "generate", "inputs": "Hello", "stream": True, "max_new_tokens": 1,
                            "max_reply_tokens": NEW_TOKENS}))
        assert json.loads(ws.recv(timeout=120)) == {
            "ok": True, "outputs": "", "stop": False, "token_count": 0,
            "waiting": f"no server holds blocks 2..3 of gap; waiting up to {BLOCK_WAIT} s"}

        http_reply = {}
        thread = threading.Thread(target=lambda: http_reply.update(http_generate(gap_gateway)))
        thread.start()  # a new request, in the gap
        deadline = time.monotonic() + 120
        while metric(gap_gateway, "swarm_client_waiting_for_blocks") < 2:
            assert time.monotonic() < deadline and thread.is_alive(), f"the HTTP request did not wait: {http_reply}"
            time.sleep(0.3)

        spans["second"] = tiny_swarm.add_server(["--blocks", "2:4", "--dht-prefix", PREFIX], wait=False)
        frames = []
        while not frames or not frames[-1].get("stop"):
            frames.append(json.loads(ws.recv(timeout=BLOCK_WAIT)))
        thread.join(BLOCK_WAIT)
    assert all(frame["ok"] and "waiting" not in frame for frame in frames)
    assert "".join(frame["outputs"] for frame in frames) == expected
    assert http_reply["outputs"] == expected
    assert metric(gap_gateway, "swarm_client_waiting_for_blocks") == 0
    assert metric(gap_gateway, "swarm_client_block_waits_total", outcome="served") == served + 2
    log = gap_gateway.log()
    assert log.count(f"no server holds blocks 2..3 of gap; waiting up to {BLOCK_WAIT} s") == 2
    assert "Traceback" not in log
