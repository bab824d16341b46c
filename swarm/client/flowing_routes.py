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

Pure functions over what servers announced; routing.py builds the chains.
"""

from __future__ import annotations

import math
from typing import Collection, Iterable, Mapping, Optional

from swarm.protocol import RemoteServer

Hop = tuple[str, int, int]  # (peer id, first block, one past the last)
_Arrival = tuple[float, int, int, Optional[str]]  # (seconds, hops, where the last hop entered, the hop before's peer)


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
    return announced if announced is not None else (client_rtt[sender] + client_rtt[receiver]) / 2


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
    (flowing_network_seconds) plus each hop's blocks x cost[server]; on a tie, fewer hops.

    A hop's price depends on the hop before (their link), so the search keeps, per position, the best chain
    ending there through each server: O(blocks x servers x span). Every position is searched, not only the
    ends of spans: announced round trips need not keep the triangle inequality, and a one-block hop through a
    server well linked to both its neighbours can then be worth its block."""
    links = announced_round_trips(servers)
    into: dict[str, dict[str, float]] = {}  # receiver -> {sender: announced round trip}
    for (sender, receiver), seconds in links.items():
        into.setdefault(receiver, {})[sender] = seconds
    positions = list(range(start, num_blocks + 1))
    best: dict[int, dict[str, _Arrival]] = {position: {} for position in positions}
    for index, entered in enumerate(positions[:-1]):
        entries = _Entries(best[entered], into, client_rtt, first=entered == start)
        for server in servers:
            info, peer = server.info, server.peer_id
            if not info.start <= entered < info.end:
                continue
            entry = entries.into(peer)
            if entry is None:
                continue
            for position in positions[index + 1:]:
                if position > info.end:
                    break
                arrival = (entry[0] + (position - entered) * cost[peer], entry[1], entered, entry[2])
                if peer not in best[position] or _better(arrival, best[position][peer]):
                    best[position][peer] = arrival
    return _chain_back(best, client_rtt, start, num_blocks)


class _Entries:
    """The cheapest ways into a hop at one position, from the chains that end there.

    Where no round trip is announced, the one way from a server to the next costs (client_rtt[before] +
    client_rtt[peer]) / 4: the best such way in is the first chain in order of its time plus
    client_rtt[before] / 4 that is neither the peer's own nor one with an announced link to it; those with one
    are priced by it. A step costs O(1 + the links announced into the peer), not O(chains ending there)."""

    def __init__(self, arrivals: Mapping[str, _Arrival], into: Mapping[str, Mapping[str, float]],
                 client_rtt: Mapping[str, float], first: bool):
        self.arrivals, self.announced, self.client_rtt, self.first = arrivals, into, client_rtt, first
        self.ranked = sorted(arrivals, key=lambda before: (arrivals[before][0] + client_rtt[before] / 4,
                                                           arrivals[before][1]))

    def into(self, peer: str) -> Optional[tuple[float, int, Optional[str]]]:
        """(seconds, hops, the hop before's peer) of the cheapest way into a hop through `peer`; None if none."""
        if self.first:
            return self.client_rtt[peer] / 2, 1, None
        announced = self.announced.get(peer, {})
        entry = None
        for before in self.ranked:
            if before != peer and before not in announced:  # a server followed by itself is one hop
                seconds, hops = self.arrivals[before][:2]
                entry = (seconds + (self.client_rtt[before] + self.client_rtt[peer]) / 4, hops + 1, before)
                break
        for before, round_trip in announced.items():
            if before in self.arrivals and before != peer:
                seconds, hops = self.arrivals[before][:2]
                candidate = (seconds + round_trip / 2, hops + 1, before)
                if entry is None or _better(candidate, entry):
                    entry = candidate
        return entry


def _chain_back(best: dict[int, dict[str, _Arrival]], client_rtt: Mapping[str, float], start: int,
                num_blocks: int) -> list[Hop]:
    """The best chain to the end, the last server's way back to the client counted, followed backwards."""
    finals = [((arrival[0] + client_rtt[peer] / 2, arrival[1]), peer) for peer, arrival in best[num_blocks].items()]
    if not finals:
        return []
    chosen = finals[0]
    for final in finals[1:]:
        if _better(final[0], chosen[0]):
            chosen = final
    hops, position, peer = [], num_blocks, chosen[1]
    while position > start:
        _, _, entered, before = best[position][peer]
        hops.append((peer, entered, position))
        position, peer = entered, before
    return hops[::-1]


def _better(candidate: tuple, incumbent: tuple) -> bool:
    """Less time, or (within rounding) as much time in fewer hops (as routing._better)."""
    tolerance = 1e-9 * max(1.0, abs(incumbent[0]))
    if candidate[0] < incumbent[0] - tolerance:
        return True
    return abs(candidate[0] - incumbent[0]) <= tolerance and candidate[1] < incumbent[1]
