"""Records of dead servers (swarm/client/peers.py DeadPeers, probes.py, swarm_client.py): a server killed without a
word keeps its DHT record until it expires; once a client finds it dead (a probe unanswered, after a step of a
session failed there), routing leaves it out for the rest of that record's life, even where only it holds some
blocks, and takes it back as soon as it announces anew. The real classes on the process's event loop, the DHT
lookup and rpc_info faked."""

import asyncio
import time

import pytest

from swarm import dht
from swarm.client import probes as probes_module
from swarm.client.peers import Bans, DeadPeers, PeerLoad
from swarm.client.probes import RoundTripProbes
from swarm.client.swarm_client import SwarmClient
from swarm.protocol import MissingBlocksError, RemoteServer, ServerInfo, ServerState


class RefusingInfo:
    """rpc_info: peers in `killed` refuse the connection at once, as a killed process's port does."""

    def __init__(self):
        self.killed, self.asked = set(), []

    async def __call__(self, p2p, peer, timeout):
        self.asked.append(peer)
        if peer in self.killed:
            raise ConnectionRefusedError(peer)
        return {}


@pytest.fixture
def rpc_info(monkeypatch):
    fake = RefusingInfo()
    monkeypatch.setattr(probes_module, "call_info", fake)
    return fake


def record(peer, start, end, expires):
    return RemoteServer(peer, ServerInfo(ServerState.ONLINE, start, end, 100.0, 1024), expires)


class Swarm:
    """What the DHT holds: the newest record of each server (fetch_servers' answer)."""

    def __init__(self, *servers):
        self.servers = list(servers)

    async def fetch(self, node, prefix, num_blocks, allowed=()):
        return list(self.servers)


def client_over(swarm: Swarm, monkeypatch) -> SwarmClient:
    """A SwarmClient's routing and its peers' bookkeeping, as __init__ wires them, over a faked lookup."""
    monkeypatch.setattr(dht, "fetch_servers", swarm.fetch)
    client = SwarmClient.__new__(SwarmClient)
    client.loop, client.node, client.region, client.allowed_servers = dht.EventLoop.get(), None, None, frozenset()
    client.bans, client.load, client.dead, client._starts = Bans(), PeerLoad(), DeadPeers(), {}
    client._told_incompatible = set()
    client.probes = RoundTripProbes(None, client.loop, client.load, client.bans, timeout=1.0, dead=client.dead)
    client.bans.on_ban = client.probes.confirm
    return client


def settle(loop):
    loop.run(asyncio.sleep(0.05))


def route(client) -> list[str]:
    return [link.peer_id for link in client.chain("tiny", 4, "tiny")]


def test_a_server_found_dead_is_no_fallback_for_the_rest_of_its_record(rpc_info, monkeypatch):
    now = time.time()
    swarm = Swarm(record("front", 0, 2, now + 30), record("killed", 2, 4, now + 30))
    client = client_over(swarm, monkeypatch)
    assert route(client) == ["front", "killed"]
    rpc_info.killed.add("killed")
    client.bans.ban("killed")  # a session's step failed there: the client probes it at once, and finds it dead
    settle(client.loop)
    assert rpc_info.asked.count("killed") >= 1 and client.dead.current() == {"killed"}
    # only the dead server holds blocks 2..3: a ban alone fell back on it (every session there would fail)
    with pytest.raises(MissingBlocksError):
        route(client)
    client.bans = Bans()  # its ban over, its record still the one it left behind: still no route through it
    with pytest.raises(MissingBlocksError):
        route(client)


def test_a_dead_server_that_announces_anew_is_routed_to_again(rpc_info, monkeypatch):
    now = time.time()
    swarm = Swarm(record("front", 0, 2, now + 30), record("back", 2, 4, now + 30))
    client = client_over(swarm, monkeypatch)
    route(client)
    rpc_info.killed.add("back")
    client.loop.run(client.probes.probe("back"))  # its periodic probe is refused
    assert client.dead.current() == {"back"}
    rpc_info.killed.clear()  # it restarted with its identity, and announced: a record that expires later
    swarm.servers[1] = record("back", 2, 4, now + 40)
    client.bans = Bans()
    assert route(client) == ["front", "back"] and client.dead.current() == set()


def test_a_probe_failing_does_not_probe_again_and_a_peer_never_seen_is_not_remembered(rpc_info):
    bans, dead = Bans(), DeadPeers()
    probes = RoundTripProbes(None, dht.EventLoop.get(), PeerLoad(), bans, timeout=1.0, dead=dead)
    bans.on_ban = probes.confirm
    rpc_info.killed.update({"stranger", "known"})
    dead.seen([record("known", 0, 4, time.time() + 30)])
    bans.ban("stranger")
    bans.ban("known")
    settle(probes.loop)
    # one confirming probe each, whose own failure strikes once more and asks for no other probe (the process's
    # event loop is shared: a real client left by an earlier test in this worker may probe its own peers meanwhile)
    assert sorted(peer for peer in rpc_info.asked if peer in {"known", "stranger"}) == ["known", "stranger"]
    assert dead.current() == {"known"} and bans.strikes("known") == 2


def test_a_dead_mark_ends_with_the_record_it_was_made_for():
    dead = DeadPeers()
    dead.seen([record("gone", 0, 4, time.time() + 0.05)])
    assert dead.found_dead("gone") and not dead.found_dead("gone")  # news once
    time.sleep(0.1)
    dead.seen([])  # its record expired: nothing of it is kept
    assert dead.current() == set() and not dead.found_dead("gone")


def test_a_server_that_refuses_a_probe_is_alive(rpc_info, monkeypatch):
    from swarm.protocol import NotAllowedError

    async def refusing(p2p, peer, timeout):  # a private server's answer to a peer not on its list
        raise NotAllowedError("not on this server's list of clients")

    monkeypatch.setattr(probes_module, "call_info", refusing)
    dead = DeadPeers()
    dead.seen([record("private", 0, 4, time.time() + 30)])
    probes = RoundTripProbes(None, dht.EventLoop.get(), PeerLoad(), Bans(), timeout=1.0, dead=dead)
    assert not probes.loop.run(probes.probe("private"))
    assert dead.current() == set() and "private" in probes.bans.current()
