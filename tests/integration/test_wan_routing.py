"""Routing over a (simulated) wide-area network, with real servers: two replicas of the whole tiny model, one
near (no added latency) and one far (--simulated-latency 200). The client measures both round trips and routes
to the near one; killed (kill -9), the near one leaves routing within PROBE_PERIOD + PROBE_TIMEOUT, long before
its record expires; restarted with the same identity after a failure or two, it is used again at once, however
long its ban (the restart earns it a probe, which it answers: Bans.may_retry); and a
session whose server leaves (SIGTERM) goes on elsewhere within a step's timeout. The tests run in order."""

import signal
import time

import pytest
import torch

from shared_swarm import TINY_BLOCKS
from swarm.client import SwarmClient
from swarm.client.probes import PROBE_PERIOD, PROBE_TIMEOUT
from swarm.local import latency_args

PREFIX = "wan"
FAR_MS = 200
HIDDEN = 64  # the tiny model's
SLACK = 5.0  # seconds of a shared, loaded machine on top of each bound


def _start(swarm, *args):
    return swarm.add_server(["--blocks", f"0:{TINY_BLOCKS}", "--dht-prefix", PREFIX, *args], wait=False)


def _ready(*servers):
    for server in servers:
        server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), 180)


@pytest.fixture(scope="module")
def identity(tmp_path_factory):
    return str(tmp_path_factory.mktemp("wan-identity") / "near.key")


@pytest.fixture(scope="module")
def replicas(tiny_swarm, identity):
    """{"near": server, "far": server}; a test that restarts the near one puts the new one here."""
    near, far = _start(tiny_swarm, "--identity", identity), _start(tiny_swarm, *latency_args(FAR_MS))
    _ready(near, far)
    return {"near": near, "far": far}


@pytest.fixture(scope="module")
def router(tiny_swarm, replicas):
    """A client of this module's own: its bans and measurements are these tests' only."""
    client = SwarmClient(tiny_swarm.initial_peers)
    yield client
    client.shutdown()


def _first_hop(router) -> str:
    return router.chain(PREFIX, TINY_BLOCKS, "tiny")[0].peer_id


def _seconds_until(condition, bound: float) -> float:
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < bound, f"not within {bound:.0f} s"
        time.sleep(0.25)
    return time.monotonic() - began


def test_routing_picks_the_replica_with_the_shorter_round_trip(router, replicas):
    near, far = replicas["near"].peer_id, replicas["far"].peer_id
    assert _first_hop(router) == near
    round_trips = router.round_trips()
    assert round_trips[far] - round_trips[near] >= 0.8 * FAR_MS / 1000  # measured, not assumed
    with router.open_session(PREFIX, TINY_BLOCKS, "tiny", max_length=8) as session:
        assert [link.peer_id for link in session.chain] == [near]


def test_a_killed_server_leaves_routing_before_its_record_expires(router, replicas):
    near = replicas["near"]
    assert _first_hop(router) == near.peer_id
    near.process.kill()  # kill -9: no withdrawal; its record says online for up to 30 s more
    _seconds_until(lambda: _first_hop(router) == replicas["far"].peer_id, PROBE_PERIOD + PROBE_TIMEOUT + SLACK)
    assert near.peer_id in router.bans.current()
    health = router.health(PREFIX, TINY_BLOCKS)  # the swarm page: no round trip shown for a server not answering
    assert near.peer_id not in health.round_trips and replicas["far"].peer_id in health.round_trips


def test_a_server_restarted_with_its_identity_is_used_again_at_once(router, replicas, tiny_swarm, identity):
    old = replicas["near"]
    router.bans.ban(old.peer_id, seconds=600)  # its second strike (the probe it failed was the first), a long ban
    restarted = replicas["near"] = _start(tiny_swarm, "--identity", identity)
    _ready(restarted)
    assert restarted.peer_id == old.peer_id
    _seconds_until(lambda: _first_hop(router) == restarted.peer_id, SLACK)


def test_a_session_whose_server_leaves_goes_on_within_a_step_timeout(router, replicas):
    near, far = replicas["near"], replicas["far"]
    inputs = torch.randn(1, 4, HIDDEN)
    with router.open_session(PREFIX, TINY_BLOCKS, "tiny", max_length=8) as session:
        assert session.chain[0].peer_id == near.peer_id
        before = session.step(inputs[:, :3])
        near.process.send_signal(signal.SIGTERM)  # leaves: withdraws its record, and its streams end
        near.process.wait(30)
        began = time.monotonic()
        after = session.step(inputs[:, 3:])
        assert time.monotonic() - began < router.step_timeout + SLACK
        assert session.chain[0].peer_id == far.peer_id
    assert before.shape == (1, 3, HIDDEN) and after.shape == (1, 1, HIDDEN)
    assert _first_hop(router) == far.peer_id  # its OFFLINE record: gone from routing at once
