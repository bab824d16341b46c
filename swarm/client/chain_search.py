"""The least-time chain of servers over a model's blocks, as routing.choose_chain prices it without flowing
steps, fast enough at thousands of servers (bench/routing_cost.py measures it).

A hop of server s over blocks [q, p) costs round_trips[s] + (p - q) x cost[s]; a chain costs the sum of its hops;
on a tie (within rounding, see better) the chain of fewer hops wins. Two steps:

1. Prune (drop_outpriced): a hop of length L through a server can be taken just as well by any server holding
   all its blocks whose round trip + L x its cost is no more: a server outpriced so at every length it could
   serve is in no chain that the others cannot match, at no more time in as many hops. Exact ties are kept, so the
   tie-breaks below still see them. Of bench/routing_cost.py's 1,000 servers, 25 (24 blocks) to about 100 (80
   blocks) stay. At worst (every server, at some hop length, the cheapest of those holding all its blocks) all
   stay, and the search below still visits each server only once per block it holds.
2. Search (search_chain): a shortest path over block positions. A hop of s entered at q and left at p costs
   (best[q] - q x cost[s]) + p x cost[s] + round_trips[s]: each server's best entry so far is kept as the search
   goes, so each position visits only the servers holding the block before it, once: the work is the sum of the
   survivors' spans, not blocks x servers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from swarm.protocol import RemoteServer


# the most cells of drop_outpriced's table (8 bytes each) built: 80 blocks need at most 80 x 80 x 80 = 512,000
MAX_TABLE_CELLS = 4_000_000


@dataclass(frozen=True)
class ChainLink:
    """One hop of a chain: this server runs blocks [start, end) (maybe only part of what it holds)."""

    peer_id: str
    start: int
    end: int


class Candidate(NamedTuple):
    """A server as the search sees it: its span clipped to the blocks searched, its prices (a tuple: a routing
    call at 10,000 servers builds 10,000 of them)."""

    peer_id: str
    start: int
    end: int
    cost: float  # seconds per block
    round_trip: float  # seconds per hop


def better(candidate: tuple, incumbent: tuple) -> bool:
    """Less time, or (within rounding) as much time in fewer hops: (seconds, hops, ...) each. The search's
    innermost test, so max() and abs() are spelled out as comparisons: the same figures, without the calls."""
    seconds = incumbent[0]
    size = seconds if seconds >= 0 else -seconds
    tolerance = 1e-9 * (size if size > 1.0 else 1.0)
    if candidate[0] < seconds - tolerance:
        return True
    difference = candidate[0] - seconds
    return (difference if difference >= 0 else -difference) <= tolerance and candidate[1] < incumbent[1]


def candidates(servers: Sequence[RemoteServer], cost: Mapping[str, float], round_trips: Mapping[str, float],
               start: int, num_blocks: int) -> list[Candidate]:
    """`servers` in their order (the order ties are broken in), spans clipped to [start, num_blocks); those
    holding none of those blocks left out."""
    clipped = []
    for server in servers:
        first, end = max(server.info.start, start), min(server.info.end, num_blocks)
        if first < end:
            peer = server.peer_id
            clipped.append(Candidate(peer, first, end, cost[peer], round_trips[peer]))
    return clipped


def drop_outpriced(servers: list[Candidate], round_trip_shares: Sequence[float] = (1.0,)) -> list[Candidate]:
    """`servers`, in order, less those outpriced at every hop length they could serve by servers holding all their
    blocks (and maybe more): each server's price of each hop length, against the least price of that length among
    the servers whose span holds its span (ties kept). Those spans are found as prefix minima over a table of
    (span start, span end, hop length); too large a table (a model of hundreds of blocks) is not built, and then
    every server is searched.

    A hop's price is its share of the round trip plus its blocks x cost; `round_trip_shares`: the shares a hop may
    pay (1: a relayed step's whole round trip; flowing steps pay a half, three quarters or all of it, by where the
    hop lies in its chain: flowing_routes.py), a server dropped only if outpriced at every length and share."""
    if len(servers) < 2:
        return servers
    firsts = np.array([server.start for server in servers])
    ends = np.array([server.end for server in servers])
    lengths = np.arange(1, int((ends - firsts).max()) + 1)
    serves = np.tile(lengths[None, :] <= (ends - firsts)[:, None], len(round_trip_shares))
    round_trips = np.array([server.round_trip for server in servers])[:, None]
    costs = np.array([server.cost for server in servers])[:, None]
    hop_seconds = np.hstack([share * round_trips + lengths[None, :] * costs for share in round_trip_shares])
    hop_seconds[~serves] = np.inf
    starts_seen, start_rank = np.unique(firsts, return_inverse=True)
    ends_seen, end_rank = np.unique(ends, return_inverse=True)
    if len(starts_seen) * len(ends_seen) * hop_seconds.shape[1] > MAX_TABLE_CELLS:
        return servers
    least = _least_per_span(hop_seconds, start_rank, end_rank, (len(starts_seen), len(ends_seen)))
    # then per span over every span holding it (starting no later, ending no earlier): prefix minima, a row or a
    # column at a time (numpy's accumulate over the table's first axes is several times slower)
    for row in range(1, len(starts_seen)):
        np.minimum(least[row - 1], least[row], out=least[row])
    for column in range(len(ends_seen) - 2, -1, -1):
        np.minimum(least[:, column + 1], least[:, column], out=least[:, column])
    keep = ((hop_seconds <= least[start_rank, end_rank]) & serves).any(axis=1)
    return [server for server, kept in zip(servers, keep) if kept]


def _least_per_span(hop_seconds: np.ndarray, start_rank: np.ndarray, end_rank: np.ndarray,
                    spans_shape: tuple[int, int]) -> np.ndarray:
    """(start rank, end rank, hop length) -> the least price among the servers of exactly that span (inf: none)."""
    span_key = start_rank * spans_shape[1] + end_rank
    order = np.argsort(span_key, kind="stable")
    sorted_keys = span_key[order]
    firsts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    least = np.full((spans_shape[0] * spans_shape[1], hop_seconds.shape[1]), np.inf)
    least[sorted_keys[firsts]] = np.minimum.reduceat(hop_seconds[order], firsts, axis=0)
    return least.reshape(*spans_shape, hop_seconds.shape[1])


def search_chain(servers: list[Candidate], start: int, num_blocks: int) -> tuple[list[ChainLink], int]:
    """The least-time chain over [start, num_blocks) through `servers` (which together hold every block of it),
    and how many (server, position) steps the search took (the sum of the servers' spans: what tests bound).

    On a tie a server earlier in `servers` wins, and a hop is entered as late as it can (the hop before goes as far
    as it can)."""
    holding: list[list[int]] = [[] for _ in range(num_blocks)]  # block -> its servers' indices, in order
    for index, server in enumerate(servers):
        for block in range(server.start, server.end):
            holding[block].append(index)
    prices = [(server.cost, server.round_trip) for server in servers]
    best: list = [None] * (num_blocks + 1)  # position -> (seconds, hops, server of the last hop, where it entered)
    best[start] = (0.0, 0, None, start)
    entry: list = [None] * len(servers)  # server -> (best[q] - q x cost, hops, q): the least so far
    steps = 0
    for position in range(start + 1, num_blocks + 1):
        before, arrived, behind = best[position - 1], None, position - 1
        for index in holding[behind]:
            steps += 1
            cost, round_trip = prices[index]
            here = (before[0] - behind * cost, before[1], behind)
            # on a tie, enter later: the hop before goes as far as it can
            if entry[index] is None or not better(entry[index], here):
                entry[index] = here
            offset, hops, entered = entry[index]
            arrival = (offset + position * cost + round_trip, hops + 1, index, entered)
            if arrived is None or better(arrival, arrived):
                arrived = arrival
        best[position] = arrived
    return _back(best, servers, start, num_blocks), steps


def _back(best: list, servers: list[Candidate], start: int, num_blocks: int) -> list[ChainLink]:
    """The chain best[num_blocks] ends, followed back hop by hop."""
    chain, position = [], num_blocks
    while position > start:
        _, _, index, entered = best[position]
        chain.append(ChainLink(servers[index].peer_id, entered, position))
        position = entered
    return chain[::-1]


def cheapest_chain(servers: Sequence[RemoteServer], cost: Mapping[str, float], round_trips: Mapping[str, float],
                   start: int, num_blocks: int) -> list[ChainLink]:
    """The least-time chain over [start, num_blocks); `servers` must hold every block of it together."""
    chain, _ = search_chain(drop_outpriced(candidates(servers, cost, round_trips, start, num_blocks)), start,
                            num_blocks)
    return chain

