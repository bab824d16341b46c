"""Server-to-server push on real servers: the first server of a chain pushes a step's outputs to the second,
which starts the step at once; when the client's own copy of those inputs arrives, the second server answers
it with the result it already has. Each position is computed once: the copy is never run again."""

import asyncio
import time

import pytest
import torch


PREFIX = "pushed"
HIDDEN = 64  # the tiny model's


@pytest.fixture(scope="module")
def chain(tiny_swarm):
    """Two servers of their own (blocks 0:2 and 2:4), so that their counters count only this test's steps."""
    servers = [tiny_swarm.add_server(["--blocks", span, "--dht-prefix", PREFIX], wait=False) for span in ("0:2", "2:4")]
    for server in servers:
        server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), 180)
    yield servers
    for server in servers:
        server.stop()


def test_a_pushed_step_is_computed_once(client, chain):
    from swarm.client.stubs import InferenceStream, call_forward, call_info

    first, second = chain
    inputs = torch.randn(1, 9, HIDDEN)
    steps = [(0, 5), (5, 6), (6, 7), (7, 8), (8, 9)]  # a prompt of five positions, then four decode steps
    p2p = client.node.p2p

    async def pushed_since(counters: dict, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while (await call_info(p2p, second.peer_id))["steps_pushed"] == counters["steps_pushed"]:
            assert time.monotonic() < deadline, "the first server's push never started the step"
            await asyncio.sleep(0.05)

    async def scenario():
        up = InferenceStream(p2p, first.peer_id, 0, 2, 30, client.step_channels)
        down = InferenceStream(p2p, second.peer_id, 2, 4, 30, client.step_channels)
        await up.open(max_length=16, batch_size=1)
        await down.open(max_length=16, batch_size=1)
        outputs = []
        try:
            for step_id, (start, end) in enumerate(steps, start=1):
                before = await call_info(p2p, second.peer_id)
                middle = await up.step(inputs[:, start:end], start, 30, step_id, push_to=down)
                await pushed_since(before)  # the pushed copy started (it may have finished) on the second server
                outputs.append(await down.step(middle, start, 30, step_id))  # the client's own copy
                after = await call_info(p2p, second.peer_id)
                assert after["steps_pushed"] == before["steps_pushed"] + 1
                # what the push computed is the answer: the client's copy of the same inputs ran nothing
                assert after["positions_served"] == before["positions_served"] + end - start, f"step {step_id}"
            return torch.cat(outputs, dim=1)
        finally:
            await up.close()
            await down.close()

    outputs = client.loop.run(scenario(), timeout=120)
    whole = client.loop.run(call_forward(p2p, first.peer_id, inputs, 0, 2, timeout=30))
    whole = client.loop.run(call_forward(p2p, second.peer_id, whole, 2, 4, timeout=30))
    torch.testing.assert_close(outputs, whole, atol=1e-4, rtol=0)
