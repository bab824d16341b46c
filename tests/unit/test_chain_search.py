"""choose_chain's search (swarm/client/chain_search.py) against the search it replaced (kept here as the
reference, `reference_chain`) and against brute force: the same cost model, the same chains."""

import itertools
import random

import pytest

from swarm.client import chain_search, routing
from swarm.client.chain_search import Candidate, ChainLink, candidates, drop_outpriced, search_chain
from swarm.client.routing import chain_step_seconds, choose_chain
from swarm.protocol import RemoteServer, ServerInfo, ServerState


def reference_chain(servers, cost, round_trips, start, num_blocks):
    """routing._cheapest_chain as it was before chain_search (every server visited at every position)."""
    best = [None] * (num_blocks + 1)
    best[start] = (0.0, 0, None)
    entry = {}
    for position in range(start + 1, num_blocks + 1):
        previous = best[position - 1]
        for server in servers:
            info, peer = server.info, server.peer_id
            if not info.start < position <= info.end:
                continue
            if previous is not None and info.start <= position - 1:
                candidate = (previous[0] - (position - 1) * cost[peer], previous[1], position - 1)
                if peer not in entry or not reference_better(entry[peer][:2], candidate[:2]):
                    entry[peer] = candidate
            if peer not in entry:
                continue
            offset, hops, entered = entry[peer]
            arrival = (offset + position * cost[peer] + round_trips[peer], hops + 1)
            if best[position] is None or reference_better(arrival, best[position][:2]):
                best[position] = (*arrival, ChainLink(peer, entered, position))
    chain, position = [], num_blocks
    while position > start:
        link = best[position][2]
        chain.append(link)
        position = link.start
    return chain[::-1]


def reference_better(candidate, incumbent):
    tolerance = 1e-9 * max(1.0, abs(incumbent[0]))
    if candidate[0] < incumbent[0] - tolerance:
        return True
    return abs(candidate[0] - incumbent[0]) <= tolerance and candidate[1] < incumbent[1]


def random_swarm(rng, servers, blocks):
    """Random spans (every block held), announced and measured speeds, round trips (some not measured), some
    servers relayed, loaded, short of cache or excluded, and where the chain starts."""
    remote, rtt, measured, load = [], {}, {}, {}
    for number in range(servers):
        span = rng.randint(1, max(1, blocks * 2 // 3))
        first = rng.randrange(0, blocks - span + 1)
        if number < 2:  # two servers that together hold every block
            first, span = (0, blocks // 2) if number == 0 else (blocks // 2, blocks - blocks // 2)
        peer = f"peer{number}"
        remote.append(RemoteServer(peer, ServerInfo(
            ServerState.ONLINE, first, first + span, rng.choice([rng.uniform(1, 500), 100.0]),
            rng.choice([0, 2**20, 2**20]), relayed=rng.random() < 0.2)))
        if rng.random() < 0.7:
            rtt[peer] = rng.choice([rng.uniform(0.0, 0.15), 0.05])  # some exact ties
        if rng.random() < 0.6:
            measured[peer] = rng.uniform(0.0005, 0.01)
        if rng.random() < 0.3:
            load[peer] = rng.choice([1.1, 1.2, 1.5])
    exclude = {f"peer{number}" for number in range(2, servers) if rng.random() < 0.1}
    options = dict(exclude=exclude, start=rng.choice([0, 0, rng.randrange(0, blocks)]), load=load,
                   min_cache_tokens=rng.choice([0, 1]), measured=measured, rtt=rtt)
    return remote, options


def prepared(remote, num_blocks, options):
    """What choose_chain hands its search: the routable servers in order, their costs and round trips."""
    servers = routing._routable(remote, num_blocks, "m", options["exclude"], options["start"],
                                options["min_cache_tokens"])
    speed = routing.seconds_per_block(servers, options["measured"])
    round_trips = routing.round_trip_estimates(servers, options["rtt"])
    servers.sort(key=lambda server: server.peer_id not in options["measured"])
    cost = {server.peer_id: speed[server.peer_id] * options["load"].get(server.peer_id, 1.0) for server in servers}
    return servers, cost, round_trips


def rated(chain, servers, options):
    """(expected step seconds, hops): what choose_chain minimises, by routing's own cost model."""
    return chain_step_seconds(chain, servers, options["rtt"], options["measured"], options["load"]), len(chain)


@pytest.mark.parametrize("seed", range(200))
def test_the_same_chain_as_the_search_it_replaced(seed):
    rng = random.Random(seed)
    num_blocks = rng.randint(8, 30)
    remote, options = random_swarm(rng, rng.randint(4, 40), num_blocks)
    servers, cost, round_trips = prepared(remote, num_blocks, options)
    old = reference_chain(servers, cost, round_trips, options["start"], num_blocks)
    new = choose_chain(remote, num_blocks, "m", **options)
    found = candidates(servers, cost, round_trips, options["start"], num_blocks)
    # the search alone, every server visited, is the old one; pruning changes no chain
    assert search_chain(found, options["start"], num_blocks)[0] == old
    assert new == old
    assert rated(new, servers, options) == rated(old, servers, options)


def brute_force_best(servers, num_blocks, options):
    """The least (seconds, hops) over every chain: each block given to any server holding it, runs of one
    server merged into one hop (a chain naming a server twice in a row costs one more round trip, never less)."""
    start = options["start"]
    holders = [[server.peer_id for server in servers if server.info.start <= block < server.info.end]
               for block in range(start, num_blocks)]
    best = None
    for owners in itertools.product(*holders):
        chain = []
        for block, owner in enumerate(owners, start):
            if chain and chain[-1].peer_id == owner:
                chain[-1] = ChainLink(owner, chain[-1].start, block + 1)
            else:
                chain.append(ChainLink(owner, block, block + 1))
        seconds, hops = rated(chain, servers, options)
        if best is None or reference_better((seconds, hops), best):
            best = (seconds, hops)
    return best


@pytest.mark.parametrize("seed", range(200))
def test_the_least_time_of_every_chain_in_the_fewest_hops(seed):
    rng = random.Random(1000 + seed)
    num_blocks = rng.randint(3, 7)
    remote, options = random_swarm(rng, rng.randint(3, 6), num_blocks)
    servers, _, _ = prepared(remote, num_blocks, options)
    seconds, hops = rated(choose_chain(remote, num_blocks, "m", **options), servers, options)
    least_seconds, least_hops = brute_force_best(servers, num_blocks, options)
    assert seconds == pytest.approx(least_seconds, rel=1e-9, abs=1e-12)
    assert hops == least_hops


def candidate(peer, first, end, cost, round_trip):
    return Candidate(peer, first, end, cost, round_trip)


def test_pruning_keeps_the_cheapest_of_a_span_at_each_hop_length_and_ties():
    servers = [candidate("near", 0, 10, 0.010, 0.01),  # cheapest for short hops
               candidate("fast", 0, 10, 0.002, 0.08),  # cheapest for long hops
               candidate("both_worse", 0, 10, 0.011, 0.09),
               candidate("twin", 0, 10, 0.010, 0.01),  # a tie: the search breaks it by order
               candidate("inside", 2, 6, 0.010, 0.02),  # outpriced by "near", which holds its blocks and more
               candidate("overhang", 2, 12, 0.010, 0.02)]  # holds blocks no cheaper server holds
    assert [server.peer_id for server in drop_outpriced(servers)] == ["near", "fast", "twin", "overhang"]


def test_without_a_table_every_server_is_searched(monkeypatch):
    servers = [candidate("near", 0, 10, 0.010, 0.01), candidate("both_worse", 0, 10, 0.011, 0.09)]
    monkeypatch.setattr(chain_search, "MAX_TABLE_CELLS", 0)
    assert drop_outpriced(servers) == servers


def test_the_search_visits_each_survivor_once_per_block_it_holds():
    # 37 spans of 8 over 80 blocks, each held by one cheap server and 49 dearer copies: 1,850 servers
    rng = random.Random(7)
    servers = []
    for copy in range(50):
        for number in range(37):
            first = 2 * number
            servers.append(candidate(f"s{number}.{copy}", first, first + 8, 0.001 * (1 + copy + rng.random()),
                                     0.02 + copy * 0.01))
    survivors = drop_outpriced(servers)
    chain, steps = search_chain(survivors, 0, 80)
    assert {server.peer_id.split(".")[1] for server in survivors} == {"0"}
    assert steps == sum(server.end - server.start for server in survivors) == 37 * 8
    assert chain == search_chain(servers, 0, 80)[0]  # the 1,813 dropped could not have served better
    assert search_chain(servers, 0, 80)[1] == 50 * 37 * 8  # unpruned, the search grows with every server
