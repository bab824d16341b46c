"""Routing for flowing steps (swarm/client/flowing.py): a step goes from the client to its chain's first
server, each server pushes it on to the next, and the last answers the client. Its network time is then the
first server's one way from the client, each server-to-server link's one way, and the last server's one way
back: half of each round trip, not each server's whole round trip from the client as with relayed steps.

A server-to-server round trip is what one of the two servers measured and announced (ServerInfo.round_trips:
its pushes' and pings' round trips, swarm/server/round_trips.py); where neither did, the mean of the two
servers' round trips from the client stands for it (two servers far from the client are not taken as close to
each other). An announced figure is a claim (bounded when parsed, see ServerInfo.from_wire) about links of the
server that announces it, never of two others: a server can make a hop to or from itself look cheaper, by at
most half the round trip otherwise counted.

Pure functions over what servers announced; routing.py builds the chains. The search (cheapest_flowing_chain)
first drops the servers that others outprice on every term of a chain's time, then walks the block positions with
numpy over the servers left: bench/routing_cost.py measures it, tests/unit/test_flowing_search.py checks it
against the search it replaced and against every chain.
"""

from __future__ import annotations

import math
from typing import Collection, Iterable, Mapping, NamedTuple, Optional

import numpy as np

from swarm.client.chain_search import Candidate, candidates, drop_outpriced
from swarm.protocol import RemoteServer

Hop = tuple[str, int, int]  # (peer id, first block, one past the last)

# a server-to-server link no server announced is priced, one way, at this share of each end's round trip from the
# client: a half, both round trips in full there and back (the triangle inequality's upper bound). The mean of the
# two (a quarter) made servers of two far regions look near each other: bench.routing_quality, with the probes
# of swarm/client/probes.py, 8% of chains within 10% of the best with a quarter, 21% with a half (median 1.19x and
# 1.16x the best). The searches and flowing_network_seconds read it here
UNANNOUNCED_LINK_SHARE = 0.5


def round_trip_shares() -> tuple[float, ...]:
    """The shares of its round trip from the client a hop pays where no link of it is announced: one
    UNANNOUNCED_LINK_SHARE for each neighbour in the chain, a half for the client's link in or out: a hop inside
    a chain two, the first or last a half and one, a chain's only hop all of it."""
    return (2 * UNANNOUNCED_LINK_SHARE, 0.5 + UNANNOUNCED_LINK_SHARE, 1.0)

NEXT_WAYS_OUT = 48  # the cheapest ways out tried at once for a server the cheapest cannot serve


def announced_round_trips(servers: Iterable[RemoteServer]) -> dict[tuple[str, str], float]:
    """(from, to) -> seconds, as the servers announced them, both ways (a link is symmetric; what the sender
    measured wins over the other's)."""
    links: dict[tuple[str, str], float] = {}
    for server in servers:
        for peer, seconds in server.info.round_trips:
            if math.isfinite(seconds) and seconds >= 0:
                links.setdefault((peer, server.peer_id), seconds)
                links[(server.peer_id, peer)] = seconds
    return links


def server_round_trip(links: Mapping[tuple[str, str], float], client_rtt: Mapping[str, float],
                      sender: str, receiver: str) -> float:
    announced = links.get((sender, receiver))
    if announced is not None:
        return announced
    return (client_rtt[sender] + client_rtt[receiver]) * 2 * UNANNOUNCED_LINK_SHARE


def flowing_network_seconds(peers: list[str], links: Mapping[tuple[str, str], float],
                            client_rtt: Mapping[str, float]) -> float:
    """A step's network time through servers `peers` in order: in from the client, along, back to it."""
    if not peers:
        return 0.0
    along = sum(server_round_trip(links, client_rtt, a, b) for a, b in zip(peers, peers[1:]))
    return (client_rtt[peers[0]] + along + client_rtt[peers[-1]]) / 2


def cheapest_flowing_chain(servers: Collection[RemoteServer], cost: Mapping[str, float],
                           client_rtt: Mapping[str, float], start: int, num_blocks: int) -> list[Hop]:
    """The least-time chain over [start, num_blocks) with flowing steps' network time
    (flowing_network_seconds) plus each hop's blocks x cost[server]; on a tie, fewer hops (then the server first
    in `servers`). Every position is searched, not only the ends of spans: announced round trips need not keep
    the triangle inequality, and a one-block hop through a server well linked to both its neighbours can then
    be worth its block.

    Servers that announce no link, and to which none is announced, are priced by their client round trip alone
    (round_trip_shares()): one of them outpriced at every hop length and share by such servers holding all its
    blocks (chain_search.drop_outpriced) is in no chain that they cannot beat, so it is dropped. The others are
    all searched (a server's announced links may make it the best neighbour of one server and no other's)."""
    found = candidates(list(servers), cost, client_rtt, start, num_blocks)
    links = _Links.among(servers, found)
    linked = np.zeros(len(found), dtype=bool)
    linked[links.sender], linked[links.receiver] = True, True
    unlinked = np.flatnonzero(~linked)
    survivors = drop_outpriced([found[number]._replace(peer_id=number) for number in unlinked],
                               round_trip_shares())
    keep = linked.copy()
    keep[[survivor.peer_id for survivor in survivors]] = True  # numbered, not named, while pruned
    kept = [server for server, chosen in zip(found, keep) if chosen]
    return _FlowingSearch(kept, links.renumbered(keep), start, num_blocks).chain()


class _Links(NamedTuple):
    """The announced links between two different servers of a list, as arrays: a row per (sender, receiver), its
    one way (half the round trip), sorted by receiver then sender; `first_into[r]`: receiver r's first row."""

    receiver: np.ndarray
    sender: np.ndarray
    one_way: np.ndarray
    first_into: np.ndarray
    codes: np.ndarray  # receiver x servers + sender, ascending: whether a pair is linked, by binary search

    @classmethod
    def among(cls, servers: Collection[RemoteServer], found: list[Candidate]) -> "_Links":
        """As announced_round_trips reads them: both ways, the sender's own figure over the receiver's."""
        index = {server.peer_id: number for number, server in enumerate(found)}
        rows = [(number, index.get(peer, -1), seconds) for server in servers
                if (number := index.get(server.peer_id)) is not None for peer, seconds in server.info.round_trips]
        table = np.array(rows, dtype=float).reshape(-1, 3)
        table = table[(table[:, 1] >= 0) & (table[:, 0] != table[:, 1]) & np.isfinite(table[:, 2])
                      & (table[:, 2] >= 0)]
        # (sender, receiver, seconds, 0: the sender's figure) and the other way (1: the receiver's), the sender's first
        both = np.vstack([np.c_[table, np.zeros(len(table))], np.c_[table[:, [1, 0, 2]], np.ones(len(table))]])
        both = both[np.lexsort((both[:, 3], both[:, 0], both[:, 1]))]
        pair = both[:, 1] * len(found) + both[:, 0]
        both = both[np.r_[True, pair[1:] != pair[:-1]]] if len(both) else both
        receiver, sender = both[:, 1].astype(np.int64), both[:, 0].astype(np.int64)
        return cls(receiver, sender, both[:, 2] / 2, np.searchsorted(receiver, np.arange(len(found) + 1)),
                   receiver * len(found) + sender)

    def renumbered(self, keep: np.ndarray) -> "_Links":
        """The same links over the servers kept (each linked server is kept), numbered in their order."""
        number, count = np.cumsum(keep) - 1, int(keep.sum())
        receiver, sender = number[self.receiver], number[self.sender]
        return _Links(receiver, sender, self.one_way, np.searchsorted(receiver, np.arange(count + 1)),
                      receiver * count + sender)

    def of(self, server: int) -> np.ndarray:
        """The servers linked with `server` (a link is announced both ways)."""
        return self.sender[self.first_into[server]:self.first_into[server + 1]]


class _FlowingSearch:
    """A shortest path over block positions, with numpy over the servers. The best chain reaching position q
    through server s as its last hop costs A(q, s) (its way back to the client not counted yet); a hop of t entered
    at q costs E(q, t) to enter, the least over s != t of A(q, s) + the one way from s to t, and A(p, t) is
    p x cost[t] plus the least of E(q, t) - q x cost[t] over q < p: kept per server as the search goes (`offset`),
    so each position prices each server once. The way in from s without an announced link costs
    (A(q, s) + rtt[s] x share) + rtt[t] x share (UNANNOUNCED_LINK_SHARE): the least over s of the first term
    serves every t but s and the servers linked to s (found further down the order); announced links are priced
    with numpy, a row each."""

    def __init__(self, servers: list[Candidate], links: _Links, start: int, num_blocks: int):
        self.servers, self.links, self.start, self.num_blocks = servers, links, start, num_blocks
        self.first = np.array([server.start for server in servers], dtype=np.int64)
        self.end = np.array([server.end for server in servers], dtype=np.int64)
        self.cost = np.array([server.cost for server in servers], dtype=float)
        self.rtt = np.array([server.round_trip for server in servers], dtype=float)

    def chain(self) -> list[Hop]:
        count = len(self.servers)
        if count == 0:
            return []
        self.offset = np.full(count, np.inf)  # the least E(q, s) - q x cost[s] so far
        self.hops = np.zeros(count, dtype=np.int64)  # and the hops of that chain
        self.entered = np.full(count, -1, dtype=np.int64)  # where its last hop entered
        self.before = np.full(count, -1, dtype=np.int64)  # and the server of the hop before (-1: the client)
        self.history: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # position -> (entered, before) then
        self.slot_of = np.zeros(count, dtype=np.int64)  # server -> its place among those entering (scratch)
        self._rows_by_position()
        self.entering_at = _by_position(self.first, self.end, self.num_blocks)  # first <= q < end
        self.ending_at = _by_position(self.first + 1, self.end + 1, self.num_blocks + 1)  # first < q <= end
        for position in range(self.start, self.num_blocks):
            arrivals = self._arrivals(position)
            entering = self.entering_at[position]
            if position == self.start:
                entry = (self.rtt[entering] / 2, np.ones(len(entering), dtype=np.int64),
                         np.full(len(entering), -1, dtype=np.int64))
            elif arrivals is None or len(entering) == 0:
                continue
            else:
                entry = self._entries(position, arrivals, entering)
            self._enter(position, entering, *entry)
        return self._back()

    def _arrivals(self, position: int) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(servers, A(position, s), hops) of the chains whose last hop ends at `position`; None if none does.
        Where each of those hops entered is kept for the way back."""
        if position == self.start:
            return None
        here = self.ending_at[position]
        here = here[np.isfinite(self.offset[here])]
        if len(here) == 0:
            return None
        self.history[position] = (self.entered.copy(), self.before.copy())
        return here, self.offset[here] + position * self.cost[here], self.hops[here]

    def _entries(self, position: int, arrivals, entering: np.ndarray):
        """(seconds, hops, server before) of the cheapest way into a hop through each of `entering`."""
        here, seconds, hops = arrivals
        way_out = seconds + self.rtt[here] * UNANNOUNCED_LINK_SHARE
        best = int(np.argmin(way_out))
        order = None  # the cheapest way out first; on a tie, fewer hops: sorted only where needed
        if np.count_nonzero(way_out == way_out[best]) > 1:
            order = np.lexsort((here, hops, way_out))
            best = int(order[0])
        entry = [way_out[best] + self.rtt[entering] * UNANNOUNCED_LINK_SHARE, np.full(len(entering), hops[best] + 1),
                 np.full(len(entering), here[best])]
        # the servers the cheapest way out cannot serve (itself, and those it has a link with): the next one
        if len(self.links.receiver):
            barred = np.zeros(len(self.servers), dtype=bool)
            barred[here[best]] = True
            barred[self.links.of(here[best])] = True
            slots = np.flatnonzero(barred[entering])
        else:
            slots = np.flatnonzero(entering == here[best])
        if len(slots):
            order = np.lexsort((here, hops, way_out)) if order is None else order
            found = self._next_ways_out(entering[slots], here, order)
            entry[0][slots] = np.where(found >= 0, way_out[found] + self.rtt[entering[slots]] * UNANNOUNCED_LINK_SHARE,
                                       math.inf)
            entry[1][slots] = np.where(found >= 0, hops[found] + 1, 0)
            entry[2][slots] = np.where(found >= 0, here[found], -1)
        if len(self.links.receiver):
            self._announced_entries(position, entering, entry)
        return entry

    def _next_ways_out(self, peers: np.ndarray, here: np.ndarray, order: np.ndarray) -> np.ndarray:
        """For each of `peers`, the first rank in `order` (ranks of `here`) of a server neither it nor linked with
        it (-1: none): among the first NEXT_WAYS_OUT with numpy, then one by one."""
        ranks = order[1:1 + NEXT_WAYS_OUT]
        senders = here[ranks]
        codes = peers[:, None] * len(self.servers) + senders[None, :]
        known = self.links.codes
        spot = np.minimum(np.searchsorted(known, codes), max(len(known) - 1, 0))
        fits = (senders[None, :] != peers[:, None]) & ~((known[spot] == codes) if len(known) else False)
        found = np.where(fits.any(axis=1), ranks[fits.argmax(axis=1)] if len(ranks) else -1, -1)
        for slot in np.flatnonzero(~fits.any(axis=1)) if len(order) > 1 + NEXT_WAYS_OUT else ():
            excluded = {int(peers[slot]), *self.links.of(peers[slot]).tolist()}
            found[slot] = next((rank for rank in order[1 + NEXT_WAYS_OUT:].tolist()
                                if int(here[rank]) not in excluded), -1)
        return found

    def _announced_entries(self, position: int, entering: np.ndarray, entry) -> None:
        """Lower `entry` where an announced link from a server with a chain ending here prices a way in less: per
        receiver, the least (seconds, hops) over its rows, the first of equals (the rows go by sender)."""
        rows = self.rows_at[self.rows_from[position]:self.rows_from[position + 1]]  # in order: receiver, sender
        senders = self.links.sender[rows]
        way_in = self.offset[senders] + position * self.cost[senders] + self.links.one_way[rows]
        reached = np.isfinite(way_in)
        rows, senders, way_in = rows[reached], senders[reached], way_in[reached]
        if len(rows) == 0:
            return
        way_hops = self.hops[senders] + 1
        self.slot_of[entering] = np.arange(len(entering))
        slots = self.slot_of[self.links.receiver[rows]]
        starts = np.r_[True, slots[1:] != slots[:-1]]
        firsts, group = np.flatnonzero(starts), np.cumsum(starts) - 1
        least = np.minimum.reduceat(way_in, firsts)
        near = ~_better(least[group], np.iinfo(np.int64).max, way_in, way_hops)  # within rounding of the least
        fewest = np.minimum.reduceat(np.where(near, way_hops, np.iinfo(np.int64).max), firsts)
        chosen = np.minimum.reduceat(np.where(near & (way_hops == fewest[group]), np.arange(len(rows)), len(rows)),
                                     firsts)
        targets = slots[chosen]
        wins = _better(way_in[chosen], way_hops[chosen], entry[0][targets], entry[1][targets])
        chosen, targets = chosen[wins], targets[wins]
        entry[0][targets], entry[1][targets], entry[2][targets] = way_in[chosen], way_hops[chosen], senders[chosen]

    def _rows_by_position(self) -> None:
        """The link rows each position prices (`rows_at[rows_from[q]:rows_from[q + 1]]`): where the sender's span
        can end a hop (first < q <= end) and the receiver's can begin one (first <= q < end)."""
        links = self.links
        low = np.maximum(self.first[links.sender] + 1, self.first[links.receiver])
        high = np.minimum(self.end[links.sender], self.end[links.receiver] - 1)
        counts = np.maximum(high - low + 1, 0)
        row = np.repeat(np.arange(len(counts)), counts)
        position = low[row] + np.arange(len(row)) - np.repeat(np.cumsum(counts) - counts, counts)
        # by position, then row (receiver, sender): a stable sort, by radix on small integers
        order = np.argsort(position.astype(np.int16 if self.num_blocks < 2**15 else np.int64), kind="stable")
        self.rows_at = row[order]
        self.rows_from = np.searchsorted(position[order], np.arange(self.num_blocks + 2))

    def _enter(self, position: int, entering: np.ndarray, seconds, hops, before) -> None:
        """Keep each server's cheapest entry so far; on a tie the earlier one (the hop before goes less far)."""
        offset = seconds - position * self.cost[entering]
        improves = _better(offset, hops, self.offset[entering], self.hops[entering]) & np.isfinite(seconds)
        chosen = entering[improves]
        self.offset[chosen], self.hops[chosen] = offset[improves], hops[improves]
        self.entered[chosen], self.before[chosen] = position, before[improves]

    def _back(self) -> list[Hop]:
        """The best chain to the end, the last server's way back to the client counted, followed backwards."""
        arrivals = self._arrivals(self.num_blocks)
        if arrivals is None:
            return []
        here, seconds, hops = arrivals
        finals = seconds + self.rtt[here] / 2
        # the least time; within rounding of it, the fewest hops; of those, the first server
        near = ~_better(np.min(finals), np.iinfo(np.int64).max, finals, hops)
        chosen = int(np.flatnonzero(near & (hops == np.min(hops[near])))[0])
        chain, position, server = [], self.num_blocks, int(here[chosen])
        while position > self.start:
            entered, before = self.history[position]
            chain.append((self.servers[server].peer_id, int(entered[server]), position))
            position, server = int(entered[server]), int(before[server])
        return chain[::-1]


def _by_position(low: np.ndarray, high: np.ndarray, positions: int) -> list[np.ndarray]:
    """For each position q < `positions`, the indices i with low[i] <= q < high[i], ascending."""
    counts = np.maximum(np.minimum(high, positions) - np.maximum(low, 0), 0)
    index = np.repeat(np.arange(len(low)), counts)
    position = np.repeat(np.maximum(low, 0) - np.cumsum(counts) + counts, counts) + np.arange(len(index))
    order = np.argsort(position, kind="stable")
    return np.split(index[order], np.searchsorted(position[order], np.arange(1, positions)))


def _better(seconds, hops, incumbent_seconds, incumbent_hops):
    """Less time, or (within rounding) as much time in fewer hops (as routing's); elementwise over arrays."""
    with np.errstate(invalid="ignore"):  # inf - inf: no chain either way, neither better
        size = np.abs(incumbent_seconds)
        tolerance = 1e-9 * np.where(np.isfinite(size), np.maximum(1.0, size), 0.0)
        return (seconds < incumbent_seconds - tolerance) | (
            (np.abs(seconds - incumbent_seconds) <= tolerance) & (hops < incumbent_hops))
