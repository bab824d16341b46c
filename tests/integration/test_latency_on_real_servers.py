"""--simulated-latency on a real block server: every exchange with it takes the round trip it says longer (an
rpc_info, a step), steps in flight overlap (eight at once take about one round trip, not eight), pushes to
it arrive delayed too, and outputs are what they would be without it. Bounds are generous on purpose: the delay
is a floor (always checked), the overlap a ceiling far below what queued messages would take."""

import asyncio
import time

import pytest
import torch

from shared_swarm import TINY_BLOCKS
from swarm.local import latency_args

PREFIX = "delayed"
ROUND_TRIP_MS = 300
HIDDEN = 64  # the tiny model's


@pytest.fixture(scope="module")
def delayed(tiny_swarm):
    server = tiny_swarm.add_server(["--blocks", f"0:{TINY_BLOCKS}", "--dht-prefix", PREFIX,
                                    *latency_args(ROUND_TRIP_MS)])
    assert f"simulated latency {ROUND_TRIP_MS} ms per round trip" in server.ready_line  # named at start-up
    return server


def _seconds(client, coroutine_factory, repeats: int = 3) -> float:
    """The least time of a few runs (the machine is shared: the least is the one least disturbed)."""
    times = []
    for _ in range(repeats):
        began = time.monotonic()
        client.loop.run(coroutine_factory())
        times.append(time.monotonic() - began)
    return min(times)


def test_an_info_call_takes_the_round_trip_longer(client, tiny_swarm, delayed):
    from swarm.client.stubs import call_info

    p2p = client.node.p2p
    plain = _seconds(client, lambda: call_info(p2p, tiny_swarm.servers[0].peer_id))
    slow = _seconds(client, lambda: call_info(p2p, delayed.peer_id))
    assert slow >= ROUND_TRIP_MS / 1000
    assert slow - plain >= 0.9 * ROUND_TRIP_MS / 1000
    assert slow < plain + 3 * ROUND_TRIP_MS / 1000  # delayed by what it says, not by some multiple of it

    async def eight_at_once():
        return await asyncio.gather(*(call_info(p2p, delayed.peer_id) for _ in range(8)))

    assert _seconds(client, eight_at_once) < 3 * ROUND_TRIP_MS / 1000  # one after the other: 8 round trips


def test_steps_in_flight_overlap_and_outputs_are_unchanged(client, tiny_swarm, delayed):
    """Eight sessions' prompts (each its own rpc_steps message on the one stream to the server) at once."""
    from swarm.client.stubs import MULTIPLEX_MAX_POSITIONS, InferenceStream

    p2p, positions = client.node.p2p, MULTIPLEX_MAX_POSITIONS + 1  # a message of its own each
    inputs = torch.randn(8, 1, positions, HIDDEN)
    plain_peer = tiny_swarm.servers[0].peer_id  # blocks 0:2; the delayed server's own 0:2 must match it

    async def prompts(peer_id: str, end: int):
        streams = [InferenceStream(p2p, peer_id, 0, end, 30, client.step_channels) for _ in range(8)]
        await asyncio.gather(*(stream.open(max_length=64, batch_size=1) for stream in streams))
        try:
            began = time.monotonic()
            outputs = await asyncio.gather(*(stream.step(inputs[index], 0, 30)
                                             for index, stream in enumerate(streams)))
            return outputs, time.monotonic() - began
        finally:
            await asyncio.gather(*(stream.close() for stream in streams))

    delayed_outputs, seconds = client.loop.run(prompts(delayed.peer_id, 2))
    plain_outputs, _ = client.loop.run(prompts(plain_peer, 2))
    assert seconds >= ROUND_TRIP_MS / 1000
    assert seconds < 4 * ROUND_TRIP_MS / 1000  # queued one behind the other, 8 would take 8 round trips
    for delayed_output, plain_output in zip(delayed_outputs, plain_outputs):
        # the servers' rounds pack the eight prompts as they arrive: float32 sums in another order
        torch.testing.assert_close(delayed_output, plain_output, atol=1e-4, rtol=0)


def test_a_step_timeout_shorter_than_the_round_trip_stretches_once_measured(tiny_swarm, delayed):
    """A client whose base step timeout (0.2 s) is below the server's round trip (0.3 s): once it has measured
    the round trip, its sessions' steps wait for it, instead of taking the far server for a dead one."""
    from swarm.client import SwarmClient

    impatient = SwarmClient(tiny_swarm.initial_peers, step_timeout=0.2, max_retries=1)
    try:
        assert impatient.chain(PREFIX, TINY_BLOCKS, "tiny")[0].peer_id == delayed.peer_id  # probed meanwhile
        assert impatient.round_trips()[delayed.peer_id] >= ROUND_TRIP_MS / 1000
        assert impatient.session_step_timeout() >= 0.2 + 2 * ROUND_TRIP_MS / 1000
        with impatient.open_session(PREFIX, TINY_BLOCKS, "tiny", max_length=8) as session:
            outputs = session.step(torch.randn(1, 3, HIDDEN))
            outputs = session.step(torch.randn(1, 1, HIDDEN))
        assert outputs.shape == (1, 1, HIDDEN)
        assert delayed.peer_id not in impatient.bans.current()
    finally:
        impatient.shutdown()
