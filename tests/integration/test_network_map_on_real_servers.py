"""A simulated network map (swarm/network_map.py) on real block servers: each message is delayed by the link it
crosses, as the map says per link. The gateway's client (no region: the map's default, home) is 300 ms from
the dc servers and 100 ms from the edge one; a client that announces the edge region is 0 ms from it and
200 ms from dc; a push from one dc server to the other crosses the 100 ms dc link once (the round trip its
sender measures, and announces in its record, is not two servers' delays added up); a flowing step through
the two dc servers takes the client's link in, the dc link along and the client's link out.

Lower bounds are what the map says, exactly (a delay is never shorter); upper bounds are loose, for a loaded
machine, but below what a delay counted twice, or the wrong link, would take."""

import json
import math
import time

import pytest
import torch

from shared_swarm import TINY_BLOCKS

PREFIX, EDGE_PREFIX = "mapped", "mapped-edge"
HIDDEN = 64  # the tiny model's
ROUTE_PREFIX = "mapped-route"
HOME_DC, DC_DC, HOME_EDGE, DC_EDGE = 0.300, 0.100, 0.100, 0.200
# "near": close to the gateway, its servers far from each other (and from dc); edge and near never meet
LINKS_MS = [["home", "home", 0], ["home", "dc", HOME_DC * 1000], ["dc", "dc", DC_DC * 1000],
            ["home", "edge", HOME_EDGE * 1000], ["dc", "edge", DC_EDGE * 1000], ["edge", "edge", 0],
            ["home", "near", 120], ["near", "near", 600], ["dc", "near", 500], ["edge", "near", 500]]
MAP = json.dumps({"round_trip_ms": LINKS_MS, "seed": 5, "default_region": "home"})


def _flags(blocks, prefix, region):
    return ["--blocks", blocks, "--dht-prefix", prefix, "--network-map", MAP, "--region", region,
            "--announce-period", "2"]


@pytest.fixture(scope="module")
def mapped(tiny_swarm):
    """dc servers of blocks 0:2 and 2:4, and an edge server of all blocks (under a prefix of its own)."""
    servers = [tiny_swarm.add_server(_flags("0:2", PREFIX, "dc"), wait=False),
               tiny_swarm.add_server(_flags("2:4", PREFIX, "dc"), wait=False),
               tiny_swarm.add_server(_flags(f"0:{TINY_BLOCKS}", EDGE_PREFIX, "edge"), wait=False)]
    for server in servers:
        server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), 180)
    assert "simulated network map: region dc, round trips to dc 100 ms, edge 200 ms, home 300 ms" in \
        servers[0].ready_line
    return servers


@pytest.fixture(scope="module")
def edge_client(tiny_swarm, mapped):
    from swarm.client import SwarmClient

    client = SwarmClient(tiny_swarm.initial_peers, region="edge")
    yield client
    client.shutdown()


def _round_trip(client, peer_id: str, runs: int = 3) -> float:
    """The least time of a few rpc_info calls (the machine is shared: the least is the one least disturbed)."""
    from swarm.client.stubs import call_info

    times = []
    for _ in range(runs):
        began = time.monotonic()
        client.loop.run(call_info(client.node.p2p, peer_id))
        times.append(time.monotonic() - began)
    return min(times)


def _settled(measure, below: float, timeout: float = 20.0) -> float:
    """A measure taken again until it is below `below` (a server reads a new caller's region from the DHT
    within a few seconds), or the last one."""
    deadline = time.monotonic() + timeout
    seconds = measure()
    while seconds >= below and time.monotonic() < deadline:
        time.sleep(1.0)
        seconds = measure()
    return seconds


def test_a_client_s_round_trip_to_each_server_is_its_link_s(client, mapped, edge_client):
    dc, _, edge = mapped
    to_dc = _round_trip(client, dc.peer_id)
    assert HOME_DC <= to_dc < HOME_DC + 0.25
    to_edge = _round_trip(client, edge.peer_id)
    assert HOME_EDGE <= to_edge < HOME_EDGE + 0.15  # another link from the same client: not dc's 300 ms
    # a client that announced its region: the edge server next to it, dc 200 ms away
    assert 0 <= _settled(lambda: _round_trip(edge_client, edge.peer_id), below=0.08) < 0.08
    assert DC_EDGE <= _settled(lambda: _round_trip(edge_client, dc.peer_id), below=HOME_DC) < HOME_DC


def test_a_flowing_step_and_its_push_cross_each_link_once(client, mapped):
    first, second, _ = mapped
    with client.open_session(PREFIX, TINY_BLOCKS, "tiny", max_length=32) as session:
        assert session.flowing is None  # the default: it flows where the links are far, as here (timed below)
        session.step(torch.randn(1, 4, HIDDEN))
        steps = []
        for _ in range(8):
            began = time.monotonic()
            session.step(torch.randn(1, 1, HIDDEN))
            steps.append(time.monotonic() - began)
    network = HOME_DC / 2 + DC_DC / 2 + HOME_DC / 2  # in to the first, pushed along, out from the second
    assert min(steps) >= network
    assert min(steps) < 2 * HOME_DC  # relayed, each server's round trip from the client: 0.6 s

    def announced() -> float:
        servers = {server.peer_id: server for server in client.servers(PREFIX, TINY_BLOCKS)}
        round_trips = dict(servers[first.peer_id].info.round_trips) if first.peer_id in servers else {}
        return round_trips.get(second.peer_id, float("inf"))

    push_round_trip = _settled(announced, below=float("inf"))  # announced every 2 s
    assert DC_DC <= push_round_trip < 2 * DC_DC  # the dc link once (counted twice: 0.2 s), not the client's


def test_routing_takes_the_chain_the_map_makes_fastest_for_flowing_steps(tiny_swarm, client, mapped):
    """Two chains of the same blocks: dc's two servers, 300 ms from the gateway and 100 ms apart, and near's,
    120 ms from the gateway but 600 ms apart. Relayed, a step pays each server's round trip from the gateway
    (near: 0.24 s, dc: 0.6 s); flowing, the gateway's link in and out once and the servers' link along (dc:
    0.35 s, near: 0.42 s). The servers ping the servers of their next block and announce what they measure; the
    client, which measures its own round trips, routes its flowing steps through dc (without the announced
    links, it would take near: their mean round trip from the client, 0.12 s, would stand for near's link)."""
    from swarm.client.routing import choose_chain

    started = [tiny_swarm.add_server(_flags(blocks, ROUTE_PREFIX, region), wait=False)
               for blocks, region in (("0:2", "dc"), ("2:4", "dc"), ("0:2", "near"), ("2:4", "near"))]
    for server in started:
        server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), 180)
    dc_first, dc_second, near_first, near_second = (server.peer_id for server in started)

    def announced(peer_id: str) -> dict[str, float]:
        servers = {server.peer_id: server for server in client.servers(ROUTE_PREFIX, TINY_BLOCKS)}
        return dict(servers[peer_id].info.round_trips) if peer_id in servers else {}

    expected = {(dc_first, dc_second): DC_DC, (dc_first, near_second): 0.5, (near_first, near_second): 0.6,
                (near_first, dc_second): 0.5}

    def links() -> dict:
        """What the first servers announce of each link, once the client has timed all four servers too. The
        first pings of a server that just started may cross a link its next servers do not know yet (a new
        peer's region is read from the DHT within a second): the median of the last few is announced, and
        settles on the link's."""
        client.chain(ROUTE_PREFIX, TINY_BLOCKS, "tiny")  # probes the servers it has not measured
        timed = {server.peer_id for server in started} <= set(client.round_trips())
        found = {peer: announced(peer) for peer in (dc_first, near_first)}
        return {pair: found[pair[0]].get(pair[1], math.inf) if timed else math.inf for pair in expected}

    def off() -> float:  # how far the links announced are from the map's, relative (0.5: 50% off)
        return max(abs(seconds / expected[pair] - 1) for pair, seconds in links().items())

    assert _settled(off, below=0.5, timeout=60) < 0.5
    assert all(seconds >= expected[pair] for pair, seconds in links().items())  # a link is never shorter
    chain = client.chain(ROUTE_PREFIX, TINY_BLOCKS, "tiny")
    assert [link.peer_id for link in chain] == [dc_first, dc_second]
    relayed = choose_chain(client.servers(ROUTE_PREFIX, TINY_BLOCKS), TINY_BLOCKS, "tiny", rtt=client.round_trips())
    assert [link.peer_id for link in relayed] == [near_first, near_second]
