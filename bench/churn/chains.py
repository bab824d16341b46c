"""Chains the gateways chose, against the best chain possible at that moment.

Each gateway logs every chain it routes a session (or a failover) through, one line per choice (SwarmClient.chain:
"routed blocks 0:24 of MODEL through PEER[0:8] PEER[8:24]"). The harness knows what routing can only measure:
every server's real round trip (its --simulated-latency) and which servers were live when the choice was made.
A choice's quality is the expected step time of the chosen chain over that of the best chain through the servers
live then, both computed alike: each hop its server's round trip plus its blocks' compute (one step's seconds
per block, measured by the servers' own throughput figures: small next to any round trip here).
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

ROUTE_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*routed blocks (\d+):(\d+) of \S+ through (.*)$")
LINK = re.compile(r"(\S+)\[(\d+):(\d+)\]")


@dataclass(frozen=True)
class Hop:
    peer_id: str
    start: int
    end: int


@dataclass(frozen=True)
class ChainChoice:
    at: float  # wall-clock time (time.time()) of the choice, from the gateway's log line
    gateway: int
    start: int
    end: int
    hops: tuple[Hop, ...]


@dataclass(frozen=True)
class LiveServer:
    peer_id: str
    start: int
    end: int
    rtt: float  # seconds


def read_choices(log_path: Path, gateway: int) -> list[ChainChoice]:
    """Every chain a gateway's log says it chose."""
    choices = []
    for line in log_path.read_text(errors="replace").splitlines():
        match = ROUTE_LINE.match(line)
        if match is None:
            continue
        stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        hops = tuple(Hop(peer, int(start), int(end)) for peer, start, end in LINK.findall(match.group(4)))
        choices.append(ChainChoice(stamp, gateway, int(match.group(2)), int(match.group(3)), hops))
    return choices


def hop_seconds(server: LiveServer, start: int, end: int, seconds_per_block: float) -> float:
    return server.rtt + (end - start) * seconds_per_block


def chain_seconds(hops: Sequence[Hop], servers: Mapping[str, LiveServer], seconds_per_block: float) -> Optional[float]:
    """Expected seconds of one decode step through the chain; None if a hop's server was not live."""
    if any(hop.peer_id not in servers for hop in hops):
        return None
    return sum(hop_seconds(servers[hop.peer_id], hop.start, hop.end, seconds_per_block) for hop in hops)


def best_seconds(servers: Sequence[LiveServer], start: int, end: int, seconds_per_block: float) -> Optional[float]:
    """The least expected step time over blocks [start, end) through these servers (None: they leave a gap).
    Hop costs add up, so a shortest path over block positions finds it exactly: a hop enters a server anywhere
    in its span and leaves it at any later block of it."""
    best: list[Optional[float]] = [None] * (end + 1)
    best[start] = 0.0
    for position in range(start, end):
        if best[position] is None:
            continue
        for server in servers:
            if not server.start <= position < server.end:
                continue
            for stop in range(position + 1, min(server.end, end) + 1):
                candidate = best[position] + hop_seconds(server, position, stop, seconds_per_block)
                if best[stop] is None or candidate < best[stop]:
                    best[stop] = candidate
    return best[end]


@dataclass
class ChoiceVerdict:
    choice: ChainChoice
    chosen: Optional[float]  # seconds; None when the chain went through a server already gone
    best: Optional[float]

    @property
    def ratio(self) -> Optional[float]:
        return None if self.chosen is None or not self.best else self.chosen / self.best


def judge(choices: Sequence[ChainChoice], live_at, seconds_per_block: float) -> list[ChoiceVerdict]:
    """Each choice against the best chain through the servers `live_at(time)` returns (LiveServers)."""
    verdicts = []
    for choice in choices:
        live = {server.peer_id: server for server in live_at(choice.at)}
        verdicts.append(ChoiceVerdict(choice, chain_seconds(choice.hops, live, seconds_per_block),
                                      best_seconds(list(live.values()), choice.start, choice.end, seconds_per_block)))
    return verdicts
