"""What a peer can make a client do with records alone (swarm/client/peers.py, probes.py, swarm_client.py), with
the real classes on the process's event loop and a fake rpc_info: announcing restarts does not clear a ban, and a
flood of records under fresh identities is probed a few at a time, without holding up routing."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from swarm import dht
from swarm.client import peers
from swarm.client import probes as probes_module
from swarm.client.peers import Bans, PeerLoad
from swarm.client.probes import FIRST_PROBES_AT_ONCE, FIRST_PROBES_PER_PERIOD, RoundTripProbes
from swarm.client.swarm_client import SwarmClient
from swarm.protocol import RemoteServer, ServerInfo, ServerState


class FakeInfo:
    """rpc_info: answers at once, or (peers in `silent`) only after the probe's timeout, with an error."""

    def __init__(self, silent=()):
        self.silent, self.asked, self.running, self.most_running = set(silent), [], 0, 0

    async def __call__(self, p2p, peer, timeout):
        self.asked.append(peer)
        if peer not in self.silent:
            return {}
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(timeout)
        finally:
            self.running -= 1
        raise TimeoutError(peer)


@pytest.fixture
def rpc_info(monkeypatch):
    fake = FakeInfo()
    monkeypatch.setattr(probes_module, "call_info", fake)
    return fake


def probes_of(bans=None, load=None, timeout=2.0, period=5.0):
    return RoundTripProbes(None, dht.EventLoop.get(), load or PeerLoad(), bans or Bans(), timeout=timeout,
                           period=period)


def settle(loop):
    """Run what the event loop was handed before now (a probe of a fake that answers at once ends in a step)."""
    loop.run(asyncio.sleep(0.01))


def record(peer, started):
    return RemoteServer(peer, ServerInfo(ServerState.ONLINE, 0, 4, 100.0, 1024, started=started))


def test_announcing_restarts_earns_a_stalling_peer_one_probe_per_ban_not_a_clean_record(rpc_info):
    client = SwarmClient.__new__(SwarmClient)  # its restart bookkeeping only: no node, no network
    client.bans, client.load, client._starts = Bans(base_seconds=30), PeerLoad(), {}
    client.probes = probes_of(client.bans, client.load)
    client.load.observed("staller", 0.5)  # slow: what routing knows of it must outlive its restarts
    client._note_restarts([record("staller", 1.0)])
    routed_again = []
    for restart in range(2, 10):  # it stalls a step, is banned, and announces a restart (twice) each time
        client.bans.ban("staller")
        client._note_restarts([record("staller", restart)])
        client._note_restarts([record("staller", restart + 0.5)])
        settle(client.probes.loop)
        routed_again.append("staller" not in client.bans.current())
    # a restart after one or two failures is believed once each (it answered its probe); never after more
    assert routed_again == [True, True] + [False] * 6
    assert rpc_info.asked == ["staller", "staller"]  # one probe per ban it earned, however many restarts it said
    assert client.bans.strikes("staller") == 8 and client.load.measured() == {"staller": 0.5}


def test_strikes_fade_with_time_not_with_restarts(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(peers, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    bans = Bans(base_seconds=30, max_seconds=600, decay_seconds=600)
    for _ in range(3):
        bans.ban("flaky")
    assert bans.strikes("flaky") == 3 and not bans.may_retry("flaky")  # too many strikes for a restart to count
    clock[0] += 1250  # two decays, and the ban (120 s) long over
    assert bans.strikes("flaky") == 1 and "flaky" not in bans.current()
    bans.ban("flaky")  # its second strike: banned for 60 s, and a restart may earn it a probe again, once
    assert bans.strikes("flaky") == 2 and bans.may_retry("flaky") and not bans.may_retry("flaky")
    clock[0] += 59
    assert "flaky" in bans.current()


def test_a_flood_of_fresh_identities_is_probed_a_few_at_a_time_and_routing_does_not_wait(rpc_info):
    flood = [f"fresh-{index}" for index in range(200)]
    rpc_info.silent.update(flood)  # records of peers that never answer (or are not there at all)
    probes = probes_of()
    probes.measure_new(["honest"])  # a server the client measured before the flood came
    began = time.monotonic()
    for _ in range(10):  # routing again and again: it routes on what it knows, and the first probes are bounded
        probes.measure_new(["honest", *flood])
    assert time.monotonic() - began < 0.5
    settle(probes.loop)
    assert len(rpc_info.asked) - 1 == rpc_info.most_running == FIRST_PROBES_AT_ONCE


def test_a_clients_first_routing_waits_only_for_the_probes_the_bounds_allow(rpc_info):
    first, second = [f"a-{index}" for index in range(200)], [f"b-{index}" for index in range(200)]
    rpc_info.silent.update(first + second)
    probes = probes_of()
    began = time.monotonic()
    probes.measure_new(first, wait=0.3)  # nothing measured yet: the first probes are waited for, that long
    assert 0.3 <= time.monotonic() - began < 0.8
    began = time.monotonic()
    probes.measure_new(second, wait=0.3)  # every first probe allowed is on its way: none begins, none waited for
    assert time.monotonic() - began < 0.2
    # only this test's peers count: a prober another test of this process left running may ask its own meanwhile
    asked = [peer for peer in rpc_info.asked if peer in {*first, *second}]
    assert len(asked) == FIRST_PROBES_AT_ONCE < FIRST_PROBES_PER_PERIOD


def test_first_probes_begun_per_period_are_bounded_even_when_they_end_at_once(rpc_info):
    probes = probes_of(period=3600.0)  # all ten batches inside one period, however loaded the machine
    for batch in range(10):  # peers that answer at once free their slots: the period's allowance still holds
        probes.measure_new([f"quick-{batch}-{index}" for index in range(50)], wait=1.0)
        settle(probes.loop)
    assert len([peer for peer in rpc_info.asked if peer.startswith("quick-")]) == FIRST_PROBES_PER_PERIOD
