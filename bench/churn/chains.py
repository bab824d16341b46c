"""Chains the gateways chose, against the best chain possible at that moment.

Each gateway logs every chain it routes a session (or a failover) through, one line per choice (SwarmClient.chain:
"routed blocks 0:24 of MODEL through PEER[0:8] PEER[8:24]"). The harness knows what routing can only measure:
every server's real round trip (its --simulated-latency) and which servers were live when the choice was made.
A choice's quality is the expected step time of the chosen chain over that of the best chain through the servers
live then, both by routing's own formula (swarm.client.routing.chain_step_seconds, flowing as the gateways do:
the network's share half of each link's round trip, a server-to-server link costing both servers' delays, as
--simulated-latency makes it) with the real round trips and one compute per block for every server (run.py's
live_at); the best chain is routing's choice (choose_chain) given those figures.
"""

from __future__ import annotations

import datetime
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from swarm.client.routing import ChainLink

ROUTE_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*routed blocks (\d+):(\d+) of \S+ through (.*)$")
LINK = re.compile(r"(\S+)\[(\d+):(\d+)\]")


@dataclass(frozen=True)
class ChainChoice:
    at: float  # wall-clock time (time.time()) of the choice, from the gateway's log line
    gateway: int
    start: int
    end: int
    hops: tuple[ChainLink, ...]  # swarm.client.routing's: which server runs which blocks


@dataclass(frozen=True)
class LiveServer:
    peer_id: str
    start: int
    end: int
    rtt: float  # seconds
    seconds_per_block: float  # compute of a decode step per block


def read_choices(log_path: Path, gateway: int) -> list[ChainChoice]:
    """Every chain a gateway's log says it chose."""
    choices = []
    for line in log_path.read_text(errors="replace").splitlines():
        match = ROUTE_LINE.match(line)
        if match is None:
            continue
        stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        hops = tuple(ChainLink(peer, int(start), int(end)) for peer, start, end in LINK.findall(match.group(4)))
        choices.append(ChainChoice(stamp, gateway, int(match.group(2)), int(match.group(3)), hops))
    return choices


def step_seconds(hops: Sequence[ChainLink], servers: Sequence[LiveServer]) -> float:
    """Expected seconds of one decode step through the chain (routing's own formula: chain_step_seconds), each
    server at its real round trip and compute per block; inf if a hop's server was not live."""
    from swarm.client.routing import chain_step_seconds

    remote, rtt, measured = _routing_inputs(servers)
    return chain_step_seconds(hops, remote, rtt, measured, {}, flowing=_flowing())


def best_chain(servers: Sequence[LiveServer], start: int, end: int) -> Optional[list[ChainLink]]:
    """The chain routing would choose over blocks [start, end) if it knew every round trip exactly (choose_chain
    with the real figures); None when the live servers leave a gap."""
    from swarm.client.routing import choose_chain
    from swarm.protocol import MissingBlocksError

    remote, rtt, measured = _routing_inputs(servers)
    try:
        return choose_chain(remote, end, "the model", start=start, measured=measured, rtt=rtt, flowing=_flowing())
    except MissingBlocksError:
        return None


def _flowing() -> bool:
    """Whether the gateways flow their steps (FLOWING_STEPS, which they inherit): routing prices chains so."""
    from config import said

    return said("FLOWING_STEPS") is not False


def _routing_inputs(servers: Sequence[LiveServer]):
    from swarm.protocol import MAX_THROUGHPUT, RemoteServer, ServerInfo, ServerState

    def throughput(server: LiveServer) -> float:  # what the server would announce: tokens/s through its span
        seconds = server.seconds_per_block * (server.end - server.start)
        return min(1.0 / seconds, MAX_THROUGHPUT) if seconds > 0 else MAX_THROUGHPUT

    def links(server: LiveServer) -> tuple[tuple[str, float], ...]:  # a push crosses both servers' delays
        return tuple((other.peer_id, server.rtt + other.rtt) for other in servers if other is not server)

    remote = [RemoteServer(server.peer_id, ServerInfo(ServerState.ONLINE, server.start, server.end, throughput(server),
                                                      2**20, round_trips=links(server))) for server in servers]
    return (remote, {server.peer_id: server.rtt for server in servers},
            {server.peer_id: server.seconds_per_block for server in servers})


@dataclass
class ChoiceVerdict:
    choice: ChainChoice
    chosen: float  # expected step seconds; inf when the chain went through a server already gone
    best: Optional[float]  # None when the live servers left a gap (the choice waited for a server)

    @property
    def ratio(self) -> Optional[float]:
        return self.chosen / self.best if self.best and math.isfinite(self.chosen) else None


def judge(choices: Sequence[ChainChoice], live_at) -> list[ChoiceVerdict]:
    """Each choice against the best chain through the servers `live_at(time)` returns (LiveServers) then."""
    verdicts = []
    for choice in choices:
        live = live_at(choice.at)
        best = best_chain(live, choice.start, choice.end)
        verdicts.append(ChoiceVerdict(choice, step_seconds(choice.hops, live),
                                      None if best is None else step_seconds(best, live)))
    return verdicts
