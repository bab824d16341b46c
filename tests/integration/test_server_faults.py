"""A real block server failing on its own (tests/faulty_server.py: its compute rounds raise after the first):
a request it fails gets the code internal_error, never a traceback; the server counts each failed round in
swarm_server_internal_errors_total and logs it once, at ERROR, with the traceback; and it goes on serving."""

import pytest
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from processes import free_port
from shared_swarm import TINY_BLOCKS
from faulty_server import FAULT, add_faulty_server
from swarm.protocol import InternalServerError

PREFIX = "faulty"
HIDDEN = 64  # the tiny model's


@pytest.fixture(scope="module")
def faulty(tiny_swarm):
    """A server of every block whose first compute round runs and every later one fails; its metrics URL."""
    port = free_port()
    server = add_faulty_server(tiny_swarm, ["--blocks", f"0:{TINY_BLOCKS}", "--dht-prefix", PREFIX,
                                            "--metrics-port", str(port)], fail_after=1)
    yield server, f"http://127.0.0.1:{port}/metrics"
    server.stop()


def internal_errors(url: str) -> dict:
    text = requests.get(url, timeout=30).text
    return {sample.labels["where"]: sample.value for family in text_string_to_metric_families(text)
            if family.name == "swarm_server_internal_errors" for sample in family.samples
            if sample.name == "swarm_server_internal_errors_total"}


def test_a_servers_own_failure_is_an_internal_error(faulty, client):
    from swarm.client.stubs import InferenceStream, call_forward

    server, url = faulty
    assert internal_errors(url) == {"compute": 0, "handler": 0}
    hidden = torch.randn(1, 3, HIDDEN)
    forward = call_forward(client.node.p2p, server.peer_id, hidden, 0, TINY_BLOCKS, timeout=30)
    assert client.loop.run(forward).shape == hidden.shape  # the first round runs

    with pytest.raises(InternalServerError, match=r"^internal server error \(see the server's log\)$") as failed:
        client.loop.run(call_forward(client.node.p2p, server.peer_id, hidden, 0, TINY_BLOCKS, timeout=30))
    assert failed.value.code == "internal_error"

    async def session_step():
        stream = InferenceStream(client.node.p2p, server.peer_id, 0, TINY_BLOCKS, 30, client.step_channels)
        await stream.open(max_length=16, batch_size=1)
        try:
            return await stream.step(hidden, 0, timeout=30, step_id=1)
        finally:
            await stream.close()

    with pytest.raises(InternalServerError) as failed:
        client.loop.run(session_step())
    assert failed.value.code == "internal_error" and FAULT not in str(failed.value)

    assert internal_errors(url) == {"compute": 2, "handler": 0}  # two failed rounds, counted once each
    log = server.log_path.read_text()
    assert log.count("a compute round of 1 request(s) failed") == 2 and log.count(FAULT) == 2
    assert log.count("Traceback") == 2 and "request failed" not in log  # logged once, not again per reply
    assert server.process.poll() is None  # it goes on serving
