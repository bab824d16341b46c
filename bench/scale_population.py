"""The simulated servers of `python -m bench.scale` and `python -m bench.routing_quality`: spans, true speeds and
link delays drawn from one stated distribution, and the records they announce.

- Spans: a few servers tile the model first (every block held), the rest hold SPAN_SHARE (1/8 to 1/2) of the
  blocks each, at uniformly random offsets.
- Compute per block of a decode step: log-normal, median COMPUTE_MEDIAN (4 ms), sigma COMPUTE_SIGMA (0.6: the
  fastest tenth about 5x faster than the slowest tenth, as consumer GPUs against data-centre ones).
- Where a server is: one of REGIONS, uniformly; the gateway is in the first. A round trip between two places is
  REGION_ROUND_TRIPS[a][b] plus each end's last mile (uniform 1-20 ms per server; the gateway's 2 ms).
- What a server announces: its true speed as throughput (honest), and its round trips to up to ANNOUNCED_LINKS
  servers of the block after its span, as servers measure and announce them (swarm/server/round_trips.py).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

REGIONS = ("eu-west", "eu-east", "us-east", "asia")
REGION_ROUND_TRIPS = (  # seconds between two regions' backbones, both ways
    (0.004, 0.030, 0.080, 0.200),
    (0.030, 0.004, 0.110, 0.180),
    (0.080, 0.110, 0.004, 0.160),
    (0.200, 0.180, 0.160, 0.004),
)
GATEWAY_REGION, GATEWAY_LAST_MILE = 0, 0.002
LAST_MILE = (0.001, 0.020)
SPAN_SHARE = (1 / 8, 1 / 2)
COMPUTE_MEDIAN, COMPUTE_SIGMA = 0.004, 0.6
ANNOUNCED_LINKS = 16  # swarm.protocol.MAX_ROUND_TRIPS


@dataclass(frozen=True)
class Simulated:
    """A simulated server: its record's fields, and the truths routing is judged by."""

    peer_id: str
    start: int
    end: int
    seconds_per_block: float  # true compute per block of a decode step
    region: int
    last_mile: float

    @property
    def client_rtt(self) -> float:
        return REGION_ROUND_TRIPS[self.region][GATEWAY_REGION] + self.last_mile + GATEWAY_LAST_MILE


def link_rtt(a: Simulated, b: Simulated) -> float:
    """The true round trip between two servers."""
    return REGION_ROUND_TRIPS[a.region][b.region] + a.last_mile + b.last_mile


def population(peer_ids: list[str], options: dict, rng: random.Random) -> list[Simulated]:
    """One simulated server per peer id, over options["blocks"] blocks."""
    blocks = options["blocks"]
    shortest, longest = max(1, round(blocks * SPAN_SHARE[0])), max(1, round(blocks * SPAN_SHARE[1]))
    servers = []
    for number, peer in enumerate(peer_ids):
        length = rng.randint(shortest, longest)
        start = rng.randrange(0, blocks - length + 1)
        if number * longest < blocks:  # the first few tile the model
            start, length = number * longest, min(longest, blocks - number * longest)
        servers.append(Simulated(peer, start, start + length, draw_compute(rng), rng.randrange(len(REGIONS)),
                                 rng.uniform(*LAST_MILE)))
    return servers


def draw_compute(rng: random.Random) -> float:
    return COMPUTE_MEDIAN * math.exp(rng.gauss(0.0, COMPUTE_SIGMA))


def records_of(servers: list[Simulated], options: dict, rng: random.Random = None,
               announcing: list[Simulated] = None) -> list:
    """The ServerInfo each of `announcing` (default: all `servers`) would announce: its true throughput (swarm's
    meaning: 1 / (compute per block x span)), and its round trips to servers of its next block."""
    from swarm.protocol import ServerInfo, ServerState

    rng = rng or random.Random(options.get("seed", 0))
    holders: dict[int, list[Simulated]] = {}
    for server in servers:
        for block in range(server.start, server.end):
            holders.setdefault(block, []).append(server)
    records = []
    for server in servers if announcing is None else announcing:
        following = holders.get(server.end, [])
        linked = rng.sample(following, min(ANNOUNCED_LINKS, len(following)))
        round_trips = tuple(sorted((other.peer_id, round(link_rtt(server, other), 6)) for other in linked))
        throughput = 1.0 / (server.seconds_per_block * (server.end - server.start))
        records.append(ServerInfo(ServerState.ONLINE, server.start, server.end, throughput, 1 << 20,
                                  max_session_tokens=8192, round_trips=round_trips))
    return records
