"""The truth of `python -m bench.routing_quality`: simulated servers whose compute and link delays drift, that
leave and join, and the best chain through them (what routing is judged against).

- Drift: each server's log compute per block and log last mile follow an Ornstein-Uhlenbeck walk around the
  value it joined with (time constant DRIFT_SECONDS, stationary sigma DRIFT_SIGMA): a server's speed wanders
  by about 20% over a minute, as a shared GPU's does with its other tenants' load.
- Churn: every `churn_every` seconds one server leaves (at random) and a new one joins, drawn from
  bench/scale_population.py's distribution (spans, speeds, regions).
- Announcing: every ANNOUNCE_PERIOD a server's record is renewed with its current speed as it measures itself
  (times one draw of the measurement noise) and its round trips to up to 16 servers of its next block.
- The best chain: the least true step time with flowing steps, by a search over block positions that prices
  every server-to-server link at its true round trip (exact: links are a region's backbone plus both last
  miles, so the cheapest way into a server is found per region: `best_seconds`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import numpy as np

from bench.scale_population import (GATEWAY_LAST_MILE, GATEWAY_REGION, REGION_ROUND_TRIPS, Simulated, link_rtt,
                                     population, records_of)

DRIFT_SECONDS, DRIFT_SIGMA = 60.0, 0.2
ANNOUNCE_PERIOD = 10.0  # a server's --announce-period

# this machine's timing noise: a 0.5 ms single-threaded task timed 400 times (2026-11-29, the 2-core machine at
# load 7-9 with other sessions' tests), each time over the least: quantiles 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99
NOISE_QUANTILES = ((0.0, 1.0), (0.1, 1.01), (0.25, 1.03), (0.5, 1.05), (0.75, 1.11), (0.9, 1.57), (0.95, 2.35),
                   (0.99, 5.09), (1.0, 8.0))


def noise(rng: random.Random, scale: float) -> float:
    """A draw of the measured-over-true ratio: NOISE_QUANTILES interpolated, its excess over 1 times `scale`."""
    u = rng.random()
    for (low, low_ratio), (high, high_ratio) in zip(NOISE_QUANTILES, NOISE_QUANTILES[1:]):
        if u <= high:
            ratio = low_ratio + (high_ratio - low_ratio) * (u - low) / (high - low)
            return 1.0 + (ratio - 1.0) * scale
    return 1.0


@dataclass
class Drifting:
    """A server now: its truths (`now`), and what it drifts around (`base`)."""

    base: Simulated
    now: Simulated
    announced_at: float


class World:
    def __init__(self, servers: int, blocks: int, seed: int, noise_scale: float, churn_every: float):
        self.rng = random.Random(seed)
        self.blocks, self.noise_scale, self.churn_every = blocks, noise_scale, churn_every
        self.joined = 0
        self.servers: dict[str, Drifting] = {}
        for simulated in population([self._new_id() for _ in range(servers)], {"blocks": blocks}, self.rng):
            self.servers[simulated.peer_id] = Drifting(simulated, simulated, -self.rng.uniform(0, ANNOUNCE_PERIOD))
        self.records: dict[str, object] = {}
        self.time, self.next_churn = 0.0, churn_every
        self.left: list[str] = []
        self._announce_due()

    def _new_id(self) -> str:
        self.joined += 1
        return f"sim{self.joined}"

    def advance(self, seconds: float) -> None:
        """Drift every server by `seconds`, churn when due, renew the records due."""
        self.time += seconds
        keep = math.exp(-seconds / DRIFT_SECONDS)
        spread = DRIFT_SIGMA * math.sqrt(1 - keep * keep)
        for server in self.servers.values():
            compute = _walk(server.now.seconds_per_block, server.base.seconds_per_block, keep, spread, self.rng)
            mile = _walk(server.now.last_mile, server.base.last_mile, keep, spread, self.rng)
            server.now = replace(server.now, seconds_per_block=compute, last_mile=mile)
        while self.time >= self.next_churn:
            self.next_churn += self.churn_every
            self._churn()
        self._announce_due()

    def _churn(self) -> None:
        gone = self.rng.choice(sorted(self.servers))
        del self.servers[gone]
        self.records.pop(gone, None)
        self.left.append(gone)
        joining = population([self._new_id()], {"blocks": self.blocks}, self.rng)[0]
        if _uncovered(self.servers.values(), self.blocks):  # a server must come back where blocks went missing
            joining = replace(joining, start=0, end=self.blocks)
        self.servers[joining.peer_id] = Drifting(joining, joining, self.time - ANNOUNCE_PERIOD)

    def _announce_due(self) -> None:
        due = [server for server in self.servers.values() if self.time - server.announced_at >= ANNOUNCE_PERIOD
               or server.now.peer_id not in self.records]
        if not due:
            return
        current = [server.now for server in self.servers.values()]
        # a server announces the speed it measured of itself and the round trips it measured to its next block
        seen = [replace(server.now, seconds_per_block=server.now.seconds_per_block
                        * noise(self.rng, self.noise_scale)) for server in due]
        for server, own, record in zip(due, seen, records_of(current, {}, self.rng, [server.now for server in due])):
            throughput = 1.0 / (own.seconds_per_block * (own.end - own.start))
            self.records[own.peer_id] = replace(record, throughput=throughput)
            server.announced_at = self.time

    def remote_servers(self) -> list:
        """What a lookup finds: each live server's latest record."""
        from swarm.protocol import RemoteServer

        return [RemoteServer(peer, record) for peer, record in self.records.items()]

    def truth(self) -> dict[str, Simulated]:
        return {peer: server.now for peer, server in self.servers.items()}


def _walk(value: float, base: float, keep: float, spread: float, rng: random.Random) -> float:
    """One step of an Ornstein-Uhlenbeck walk of log(value) around log(base)."""
    return base * math.exp(math.log(value / base) * keep + rng.gauss(0.0, spread))


def _uncovered(servers, blocks: int) -> bool:
    held = np.zeros(blocks, dtype=bool)
    for server in servers:
        held[server.now.start:server.now.end] = True
    return not held.all()


def chain_seconds(chain, truth: dict[str, Simulated], load=None) -> float:
    """A chain's true step time with flowing steps: the gateway's link in to the first server and back from the
    last (half each round trip), half each server-to-server round trip, and each hop's blocks x compute (x the
    gateway's load factor of the server, if given); inf if a server of it is gone."""
    load = load or {}
    if any(link.peer_id not in truth for link in chain):
        return math.inf
    servers = [truth[link.peer_id] for link in chain]
    network = servers[0].client_rtt + servers[-1].client_rtt + sum(link_rtt(a, b) for a, b in zip(servers, servers[1:]))
    compute = sum((link.end - link.start) * truth[link.peer_id].seconds_per_block * load.get(link.peer_id, 1.0)
                  for link in chain)
    return network / 2 + compute


def best_seconds(truth: dict[str, Simulated], blocks: int, load=None) -> float:
    """The least true step time over every chain (chain_seconds), by a search over block positions. A way into
    server t from s costs (backbone(region s, region t) + mile s + mile t) / 2: per region of s, the least of
    A(q, s) + mile s / 2 (the second least where the least is t itself) serves every t."""
    load = load or {}
    servers = list(truth.values())
    first = np.array([server.start for server in servers])
    end = np.array([server.end for server in servers])
    cost = np.array([server.seconds_per_block * load.get(server.peer_id, 1.0) for server in servers])
    mile = np.array([server.last_mile for server in servers])
    region = np.array([server.region for server in servers])
    backbone = np.array(REGION_ROUND_TRIPS)
    client = backbone[region, GATEWAY_REGION] + mile + GATEWAY_LAST_MILE
    offset = np.where(first == 0, client / 2, np.inf)  # entered at 0: the gateway's link in
    for position in range(1, blocks + 1):
        ending = (first < position) & (position <= end)
        arrival = np.where(ending, offset + position * cost, np.inf)
        if position == blocks:
            return float(np.min(arrival + client / 2))
        way_out = arrival + mile / 2
        way_in = np.full(len(servers), np.inf)
        for place in range(len(REGION_ROUND_TRIPS)):
            here = np.where(region == place, way_out, np.inf)
            order = np.argsort(here)[:2]
            least = np.where(np.arange(len(servers)) == order[0], here[order[1]], here[order[0]])
            way_in = np.minimum(way_in, least + backbone[place, region] / 2)
        entering = (first <= position) & (position < end)
        offset = np.where(entering, np.minimum(offset, way_in + mile / 2 - position * cost), offset)
    return math.inf
