"""Routing for flowing steps (swarm/client/flowing_routes.py): a chain's network time is half the client's round
trip to its first server, half each server-to-server round trip the servers announce (the mean of the two
client round trips where none is), and half the last server's back; the best chain by that measure is found
(checked against every chain on small random swarms). Also: the round trips a record announces parse within
bounds, and what a server announces of its pushes."""

import itertools
import math
import random

import pytest

from swarm.client.flowing_routes import cheapest_flowing_chain, flowing_network_seconds, announced_round_trips
from swarm.client.routing import ChainLink, chain_step_seconds, choose_chain
from swarm.protocol import MAX_ROUND_TRIPS, RemoteServer, ServerInfo, ServerState
from swarm.server.round_trips import PushRoundTrips


def _server(peer, start, end, throughput=1000.0, round_trips=()):
    return RemoteServer(peer, ServerInfo(ServerState.ONLINE, start, end, throughput, 1 << 20,
                                         round_trips=tuple(round_trips)))


def _hops(chain):
    return [(link.peer_id, link.start, link.end) for link in chain]


def test_two_servers_close_to_each_other_and_far_from_the_gateway_win_with_flowing_steps():
    """A map of two data centres 200 ms from the gateway: dc1 holds both halves (its servers 10 ms apart, as
    they announce), dc2's halves are 100 ms from the gateway but 400 ms apart. Relayed, a step pays each
    server's round trip from the gateway: dc2 wins (0.2 s against 0.4). Flowing, it pays the gateway's link
    in and out once and the link between the servers: dc1 wins (0.205 s against 0.3)."""
    servers = [_server("dc1-a", 0, 2, round_trips=[("dc1-b", 0.010)]), _server("dc1-b", 2, 4),
               _server("dc2-a", 0, 2, round_trips=[("dc2-b", 0.400)]), _server("dc2-b", 2, 4)]
    rtt = {"dc1-a": 0.2, "dc1-b": 0.2, "dc2-a": 0.1, "dc2-b": 0.1}
    relayed = choose_chain(servers, 4, "m", rtt=rtt)
    flowing = choose_chain(servers, 4, "m", rtt=rtt, flowing=True)
    assert [link.peer_id for link in relayed] == ["dc2-a", "dc2-b"]
    assert [link.peer_id for link in flowing] == ["dc1-a", "dc1-b"]
    compute = 4 / 1000 / 2  # each server's claimed throughput over its two blocks
    assert chain_step_seconds(flowing, servers, rtt, {}, {}, flowing=True) == pytest.approx(0.205 + compute)
    assert chain_step_seconds(relayed, servers, rtt, {}, {}, flowing=True) == pytest.approx(0.3 + compute)
    assert chain_step_seconds(relayed, servers, rtt, {}, {}) == pytest.approx(0.2 + compute)


def test_without_announced_round_trips_the_client_round_trips_stand_for_them():
    """One slow server over all blocks against two fast halves, all 200 ms from the gateway: the halves win only
    when they announce that they are close to each other."""
    whole = _server("whole", 0, 4, throughput=1 / 0.03 / 4)  # 30 ms per block
    halves = [_server("a", 0, 2, throughput=1 / 0.01 / 2), _server("b", 2, 4, throughput=1 / 0.01 / 2)]
    rtt = {"whole": 0.2, "a": 0.2, "b": 0.2}
    assert _hops(choose_chain([whole, *halves], 4, "m", rtt=rtt, flowing=True)) == [("whole", 0, 4)]  # 0.32 < 0.34
    close = _server("a", 0, 2, throughput=1 / 0.01 / 2, round_trips=[("b", 0.01)])
    assert _hops(choose_chain([whole, close, halves[1]], 4, "m", rtt=rtt, flowing=True)) == [("a", 0, 2), ("b", 2, 4)]
    # b's own figure for the link counts too (a link is symmetric), the sender's first
    b_says = _server("b", 2, 4, throughput=1 / 0.01 / 2, round_trips=[("a", 0.01)])
    assert announced_round_trips([halves[0], b_says])[("a", "b")] == 0.01


def _brute_force(servers, cost, rtt, num_blocks):
    """Every chain (any switch positions), its flowing time: the least, and its hop count."""
    links = announced_round_trips(servers)
    best = (math.inf, 0)
    for cuts_count in range(num_blocks):
        for cuts in itertools.combinations(range(1, num_blocks), cuts_count):
            edges = [0, *cuts, num_blocks]
            choices = [[s for s in servers if s.info.start <= a and b <= s.info.end] for a, b in zip(edges, edges[1:])]
            for chosen in itertools.product(*choices):
                peers = [s.peer_id for s in chosen]
                if any(a == b for a, b in zip(peers, peers[1:])):
                    continue
                seconds = flowing_network_seconds(peers, links, rtt) + sum(
                    (b - a) * cost[s.peer_id] for s, a, b in zip(chosen, edges, edges[1:]))
                best = min(best, (seconds, len(peers)))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_chain_found_is_the_cheapest_of_all(seed):
    rng = random.Random(seed)
    num_blocks, servers = 6, []
    for number in range(5):
        start = rng.randrange(0, num_blocks)
        end = rng.randrange(start + 1, num_blocks + 1)
        servers.append((f"p{number}", start, end))
    servers += [("cover", 0, num_blocks)]
    peers = [peer for peer, _, _ in servers]
    remote = [_server(peer, start, end, round_trips=[(other, rng.uniform(0, 0.2)) for other in peers
                                                     if other != peer and rng.random() < 0.5])
              for peer, start, end in servers]
    cost = {peer: rng.uniform(0.001, 0.05) for peer in peers}
    rtt = {peer: rng.uniform(0.01, 0.3) for peer in peers}
    hops = cheapest_flowing_chain(remote, cost, rtt, 0, num_blocks)
    assert hops[0][1] == 0 and hops[-1][2] == num_blocks
    assert all(a[2] == b[1] for a, b in zip(hops, hops[1:]))
    seconds = flowing_network_seconds([peer for peer, _, _ in hops], announced_round_trips(remote), rtt) + sum(
        (end - start) * cost[peer] for peer, start, end in hops)
    expected = _brute_force(remote, cost, rtt, num_blocks)
    assert seconds == pytest.approx(expected[0], rel=1e-9)
    assert len(hops) <= expected[1] or seconds < expected[0] - 1e-12


def test_a_chain_from_a_later_block_starts_from_the_client():
    servers = [_server("a", 0, 4), _server("b", 2, 6)]
    chain = choose_chain(servers, 6, "m", start=3, rtt={"a": 0.05, "b": 0.05}, flowing=True)
    assert chain == [ChainLink("b", 3, 6)]


def test_announced_round_trips_parse_within_bounds():
    good = {"state": 2, "start": 0, "end": 2, "throughput": 10.0, "cache_tokens_free": 64}
    assert ServerInfo.from_wire(good).round_trips == ()  # a record older than the field
    info = ServerInfo.from_wire({**good, "round_trips": {"QmB": 0.02, "QmA": 0}})
    assert info.round_trips == (("QmA", 0.0), ("QmB", 0.02))
    assert ServerInfo.from_wire(info.to_wire()) == info
    assert "round_trips" not in ServerInfo.from_wire(good).to_wire()  # as older servers wrote it
    too_many = {f"Qm{index}": 0.01 for index in range(1, MAX_ROUND_TRIPS + 2)}
    for bad in ([["QmA", 0.01]], too_many, {"QmA": -0.001}, {"QmA": math.nan}, {"QmA": math.inf}, {"QmA": 61.0},
                {"QmA": True}, {"QmA": "0.01"}, {"Qm0": 0.01}, {"": 0.01}, {"Q" * 129: 0.01}, {1: 0.01}):
        assert ServerInfo.from_wire({**good, "round_trips": bad}) is None, bad


def test_a_server_announces_the_median_of_its_last_pushes_to_the_latest_servers():
    log = PushRoundTrips()
    for seconds in (0.010, 0.011, 0.500, 0.012, math.nan, -1.0):  # one push queued behind a burst
        log.add("QmA", seconds)
    assert log.announced() == (("QmA", 0.0115),)
    names = [f"QmP{letter}" for letter in "abcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQ"]  # base58, as peer ids are
    for name in names:
        log.add(name, 99.0)
    announced = dict(log.announced())
    assert len(announced) == MAX_ROUND_TRIPS and names[-1] in announced and "QmA" not in announced
    assert set(announced.values()) == {60.0}  # within the records' bounds
    info = ServerInfo(ServerState.ONLINE, 0, 2, 10.0, 64, round_trips=log.announced())
    assert ServerInfo.from_wire(info.to_wire()) == info


def test_a_record_announcing_every_round_trip_stays_far_under_the_dht_s_value_bound():
    """16 round trips under real peer ids (46 base58 characters) and 8 adapters, signed as the DHT stores the
    record: under trust.MAX_VALUE_BYTES, or every announcement would be refused."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    from swarm.trust import MAX_VALUE_BYTES

    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    peers = [f"Qm{alphabet[index] * 44}" for index in range(MAX_ROUND_TRIPS)]
    info = ServerInfo(ServerState.ONLINE, 0, 8, 1234.5, 32768, max_session_tokens=8192, started=1.7e9,
                      adapters=tuple(f"adapter-{index}-{'x' * 20}" for index in range(8)),
                      round_trips=tuple((peer, 0.123456789) for peer in peers))
    validator = RSASignatureValidator()
    record = DHTRecord(key=MSGPackSerializer.dumps("SmolLM2-135M-Instruct.0"),
                       subkey=MSGPackSerializer.dumps(validator.local_public_key),
                       value=MSGPackSerializer.dumps(info.to_wire()), expiration_time=1e9)
    assert len(validator.sign_value(record)) < MAX_VALUE_BYTES * 0.75


def test_a_server_pings_the_servers_of_its_next_block(monkeypatch):
    """Before any session routes through both, a server measures its round trip to each server of the block
    after its span (an rpc_info), so that routing prices their link by it; a peer not answering is left out."""
    import asyncio

    from swarm.server import pushes

    class Targets:
        async def servers_of(self, block):
            assert block == 2
            return {"QmB", "QmC", "QmSe1f"}

    class Stub:
        def __init__(self, peer):
            self.peer = peer

        async def rpc_info(self, request, timeout):
            assert self.peer != "QmSe1f"  # never itself
            if self.peer == "QmC":
                raise ConnectionError("gone")
            await asyncio.sleep(0.05)

    monkeypatch.setattr(pushes.BlockRPC, "get_stub", staticmethod(lambda p2p, peer: Stub(peer.to_base58())))
    pusher = pushes.Pusher({}, Targets())
    pusher.p2p = object()
    asyncio.run(pusher.ping_next(2, "QmSe1f"))
    announced = dict(pusher.round_trips.announced())
    assert set(announced) == {"QmB"} and 0.05 <= announced["QmB"] < 0.5
