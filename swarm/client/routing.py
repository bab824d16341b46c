"""Pure choices over what servers announced: which chain of servers serves a session, and which LoRA adapters
of a model a client names."""

from __future__ import annotations

import math
from collections import Counter
from typing import Collection, Iterable, Mapping, Optional

from swarm.client.chain_search import ChainLink, cheapest_chain
from swarm.client.flowing_routes import announced_round_trips, cheapest_flowing_chain, flowing_network_seconds
from swarm.protocol import (MAX_THROUGHPUT, PROTOCOL_VERSION, MissingBlocksError, RemoteServer, format_block_ranges,
                            missing_ranges)


MAX_ADAPTERS_PER_MODEL = 32  # LoRA adapters of one model a client names (lists, serves), the best announced first

# the round trip assumed of a server not measured yet, while no server is: a hop is never free (on loopback it
# costs about a millisecond; across the internet 20-150 ms)
DEFAULT_ROUND_TRIP = 0.02


def protocol_line(version: str) -> Optional[tuple[int, int]]:
    """(major, minor) of a version such as "0.6.0"; None when it is not one (a record older than the field: "")."""
    parts = version.split(".")
    if len(parts) < 2 or not all(part.isdigit() and len(part) <= 6 for part in parts[:2]):
        return None
    return int(parts[0]), int(parts[1])


def speaks(version: str, own: str = PROTOCOL_VERSION) -> bool:
    """Whether a client of protocol `own` can talk to a server announcing `version`: the same major and minor.
    Before 1.0 each minor version changed the messages both ways (0.4 stacked a message's steps, 0.5 declared
    the next step's positions, 0.6 flowing steps): a server of another one refuses this client's steps, or
    answers what it cannot read. A patch version changes nothing the other side reads."""
    line = protocol_line(version)
    return line is not None and line == protocol_line(own)


def choose_chain(
    servers: Collection[RemoteServer],
    num_blocks: int,
    model_name: str,
    exclude: Collection[str] = (),
    start: int = 0,
    load: Optional[Mapping[str, float]] = None,
    min_cache_tokens: int = 0,
    measured: Optional[Mapping[str, float]] = None,
    rtt: Optional[Mapping[str, float]] = None,
    flowing: bool = False,
) -> list[ChainLink]:
    """The chain covering blocks [start, num_blocks) with the least expected decode step time
    (chain_step_seconds): each hop costs its server's round trip plus its blocks' compute; on a tie, fewer hops.

    A server's time per block is what the client `measured` there (compute only: the network's share of a
    step is its round trip), else what it announced, within bounds (see seconds_per_block); `load[peer]`
    multiplies it. `rtt[peer]`: the round trips measured to each server (see round_trip_estimates for those not
    measured). A hop may enter a server mid-span and leave it before its end, where a faster server takes over.
    Servers announcing less free cache than `min_cache_tokens` are left out while others can serve.
    With `flowing` (flowing steps), the network's share is priced as a flowing step crosses it instead: half
    the client's round trip to the first and from the last server, and half each server-to-server one
    (swarm/client/flowing_routes.py). The search without flowing: swarm/client/chain_search.py.
    """
    servers = _routable(servers, num_blocks, model_name, exclude, start, min_cache_tokens)
    load = load or {}
    speed = seconds_per_block(servers, measured or {})
    round_trips = round_trip_estimates(servers, rtt or {})
    servers.sort(key=lambda server: server.peer_id not in (measured or {}))  # on a tie, a server measured first
    cost = {server.peer_id: speed[server.peer_id] * load.get(server.peer_id, 1.0) for server in servers}

    if flowing:
        return [ChainLink(*hop) for hop in cheapest_flowing_chain(servers, cost, round_trips, start, num_blocks)]
    return cheapest_chain(servers, cost, round_trips, start, num_blocks)


def chain_step_seconds(chain: Iterable[ChainLink], servers: Collection[RemoteServer], rtt: Mapping[str, float],
                       measured: Mapping[str, float], load: Mapping[str, float], flowing: bool = False) -> float:
    """Expected seconds of one decode step through `chain`: over its hops, the server's round trip plus its
    blocks x its time per block (measured, else announced: seconds_per_block) x its load; what choose_chain
    minimises (with `flowing`, the network's share as flowing_routes prices it). A server of the chain missing
    from `servers` counts as infinitely slow."""
    known = {server.peer_id: server for server in servers}
    speed = seconds_per_block(known.values(), measured)
    round_trips = round_trip_estimates(known.values(), rtt)
    chain = list(chain)
    if any(link.peer_id not in known for link in chain):
        return math.inf
    compute = sum((link.end - link.start) * speed[link.peer_id] * load.get(link.peer_id, 1.0) for link in chain)
    if flowing:
        peers = [link.peer_id for link in chain]
        return compute + flowing_network_seconds(peers, announced_round_trips(known.values()), round_trips)
    return compute + sum(round_trips[link.peer_id] for link in chain)


def round_trip_estimates(servers: Iterable[RemoteServer], rtt: Mapping[str, float]) -> dict[str, float]:
    """Each server's round trip: as measured, else the median of those measured (a new server is neither
    preferred nor shunned before it is measured), else DEFAULT_ROUND_TRIP; a relayed server's priced up (see
    relayed_round_trip)."""
    servers = list(servers)
    known = sorted(seconds for peer, seconds in rtt.items() if math.isfinite(seconds) and seconds >= 0)
    fallback = known[len(known) // 2] if known else DEFAULT_ROUND_TRIP
    estimates = {}
    for server in servers:
        peer = server.peer_id
        measured = peer in rtt and math.isfinite(rtt[peer]) and rtt[peer] >= 0
        seconds = rtt[peer] if measured else fallback
        estimates[peer] = relayed_round_trip(seconds, measured) if server.info.relayed else seconds
    return estimates


# a relayed server (behind a NAT: swarm/relays.py) not measured yet: every message to it and back goes through its
# relay, two legs where a direct server's takes one, so about twice the round trip of a direct server
RELAYED_ROUND_TRIP_FACTOR = 2.0
# and measured or not, this much more per step: its measured round trip counts the detour, but not the rest of
# what a relayed hop costs: the pushes to it and from it take the detour too, its relay is one shared peer whose
# bandwidth and slots every server behind it depends on, and a relay resets a circuit past its limits (a failover)
RELAYED_HOP_SECONDS = 0.005


def relayed_round_trip(seconds: float, measured: bool) -> float:
    """What a relayed hop is priced at in routing: on a near tie, a direct server wins."""
    return (seconds if measured else seconds * RELAYED_ROUND_TRIP_FACTOR) + RELAYED_HOP_SECONDS


def _routable(servers: Collection[RemoteServer], num_blocks: int, model_name: str, exclude: Collection[str],
              start: int, min_cache_tokens: int) -> list[RemoteServer]:
    """The servers a chain may use: not excluded, and with room for the session if enough of them have it."""
    servers = [server for server in servers if server.peer_id not in exclude]
    roomy = [server for server in servers if server.info.cache_tokens_free >= min_cache_tokens]
    if _hold_every_block(roomy, num_blocks, start):
        return roomy
    if not _hold_every_block(servers, num_blocks, start):
        missing = missing_ranges(servers, num_blocks, start)
        raise MissingBlocksError(f"no server holds blocks {format_block_ranges(missing)} of {model_name}")
    return servers


def _hold_every_block(servers: Collection[RemoteServer], num_blocks: int, start: int) -> bool:
    """Whether `servers` together hold blocks [start, num_blocks): a sweep over their spans by start, O(servers)
    where missing_ranges walks every block of every span (a routing call at 1,000 servers checks it twice)."""
    reached = start
    for first, end in sorted((server.info.start, server.info.end) for server in servers):
        if first > reached:
            break
        reached = max(reached, end)
    return reached >= num_blocks


def seconds_per_block(servers: Iterable[RemoteServer], measured: Mapping[str, float]) -> dict[str, float]:
    """Each server's time per block of a decode step, as far as the client can trust it.

    What a server announces is only a claim (records parse within bounds, see ServerInfo.from_wire): once the
    client has measured a server, the claim can make it look slower, never faster, than measured; a server not
    measured yet is taken as no faster than the fastest one measured, so that a claim alone never outranks a
    speed the client has seen (it is tried when the measured ones are busier, and measured then).
    """
    claimed = {server.peer_id: 1.0 / (_believable(server.info.throughput) * (server.info.end - server.info.start))
               for server in servers}
    measured = {peer: seconds for peer, seconds in measured.items() if peer in claimed and math.isfinite(seconds)}
    floor = min(measured.values(), default=0.0)  # a claim faster than every measured server is believed that far
    return {peer: max(claim, measured.get(peer, floor)) for peer, claim in claimed.items()}


def _believable(throughput: float) -> float:
    """A claimed throughput within the records' bounds; anything else (NaN, inf, 0: not parsed from the DHT,
    but a record may be built by hand) counts as the slowest possible."""
    return min(throughput, MAX_THROUGHPUT) if math.isfinite(throughput) and throughput > 0 else 1e-9


def longest_session(servers: Iterable[RemoteServer], num_blocks: int) -> Optional[int]:
    """For each block, the best max_session_tokens among the servers holding it; the least of those over the
    blocks: the longest session a chain of these servers can hold. None if unknown (a block with no server, or
    only servers whose records predate the field)."""
    best: list[Optional[int]] = [None] * num_blocks
    for server in servers:
        tokens = server.info.max_session_tokens
        if tokens is None:
            continue
        for index in range(server.info.start, min(server.info.end, num_blocks)):
            best[index] = tokens if best[index] is None else max(best[index], tokens)
    return None if not best or None in best else min(best)


def announced_adapters(servers: Iterable[RemoteServer], most: int = MAX_ADAPTERS_PER_MODEL) -> list[str]:
    """The LoRA adapters `servers` announce, at most `most`: those with the most votes first, each server's record
    weighing one vote in all, shared among the adapters it names (a record naming 256 adapters gives each 1/256:
    a peer cannot crowd out the adapters of servers that name a few by naming many); on a tie, by name."""
    votes: Counter[str] = Counter()
    for server in servers:
        for adapter in server.info.adapters:
            votes[adapter] += 1 / len(server.info.adapters)
    return sorted(votes, key=lambda adapter: (-round(votes[adapter], 9), adapter))[:most]
