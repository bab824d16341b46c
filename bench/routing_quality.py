"""`python -m bench.routing_quality`: how close the chains routing chooses come to the best, when the truth is
known: a simulated swarm of --servers servers (bench/quality_world.py: true speeds and link delays that drift,
a leave and a join every --churn-every seconds, this machine's timing noise on every measurement) and one
gateway whose routing is the real code, fed as SwarmClient feeds it.

    python -m bench.routing_quality [--servers 1000] [--blocks 80] [--seconds 120] [--warmup 60]
                                    [--sessions-per-second 2] [--session-steps 20] [--churn-every 3]
                                    [--noise 1.0] [--variants today,before,exact,...] [--seed 0]
                                    [--json PATH]

The gateway (SimulatedGateway): each chain is routing.choose_chain(..., flowing=True) over the records the
servers announced (throughput, round trips to their next block's servers), with the real PeerLoad's figures:
its sessions per server (factors), the round trip to each server as the least of its last probes, and the
compute per block as the least of its last decode steps there (a step's time less the round trip, per block),
forgotten COMPUTE_FRESH_SECONDS after the last. Probes follow swarm/client/probes.py's policy and bounds (every
PROBE_PERIOD the PROBES_PER_ROUND least recently probed, and FIRST_PROBES_PER_PERIOD first probes of servers never
probed, at random). Sessions open at --sessions-per-second, take --session-steps decode steps (one a second) and
close; a session whose server left is routed again. Each choice after --warmup is judged: its true step time
(flowing, the gateway's load factors counted) over the best chain's (quality_world.best_seconds).

Variants (--variants): `today` (as the gateway is); `before` (as it was before these figures were first taken:
compute the median of the last 15 steps, never forgotten; probes bounded at 64 again and 32 first per period;
unannounced links priced at a quarter of the two round trips); each of those three alone (`median-kept`,
`probes-64-32`, `quarter-links`); `no-noise` (measurements exact); `probe-all` (every server probed every period);
`exact` (routing given the true round trip and compute of every server: what the cost model alone loses, its
link estimates against the true links).
Prints a Markdown table; exits 0.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass, field

from bench.quality_world import World, best_seconds, chain_seconds, noise

# name -> how the gateway differs from today's: its compute figures kept as before issue 42's routing work (the
# median of the last 15 steps, never forgotten), its probes' bounds per period (re-probes, first probes),
# unannounced links' price (flowing_routes.UNANNOUNCED_LINK_SHARE), measurements without noise, every server probed
# every period, or routing given every server's true round trip and compute
VARIANTS = {"today": {}, "before": {"median_kept": True, "probes": (64, 32), "link_share": 0.25},
            "median-kept": {"median_kept": True}, "probes-64-32": {"probes": (64, 32)},
            "quarter-links": {"link_share": 0.25}, "no-noise": {"no_noise": True}, "probe-all": {"probe_all": True},
            "exact": {"exact": True}}


def median_kept_load():
    """A PeerLoad (swarm/client/peers.py) that keeps compute as it did before: the median of the last
    COMPUTE_SAMPLES steps, never forgotten."""
    import statistics

    from swarm.client.peers import PeerLoad

    class MedianKept(PeerLoad):
        def observed(self, peer_id: str, seconds: float, blocks: int = 1) -> None:
            super().observed(peer_id, seconds, blocks)
            with self._lock:
                self.latency[peer_id] = statistics.median(self._compute_samples[peer_id])

        def measured(self) -> dict[str, float]:
            with self._lock:
                return dict(self.latency)

    return MedianKept()


@dataclass
class Session:
    chain: list
    steps_left: int


@dataclass
class Judged:
    ratios: list = field(default_factory=list)
    route_seconds: list = field(default_factory=list)  # choose_chain's time, each call
    measured_share: list = field(default_factory=list)  # of a chosen chain's servers, those the gateway measured


class SimulatedGateway:
    """A gateway's routing inputs, kept as SwarmClient keeps them (swarm/client/peers.PeerLoad), from
    simulated probes and steps."""

    def __init__(self, world: World, rng: random.Random, noise_scale: float, probe_all: bool = False,
                 exact: bool = False, median_kept: bool = False, probes: tuple = ()):
        from swarm.client.peers import PeerLoad
        from swarm.client.probes import FIRST_PROBES_PER_PERIOD, PROBE_PERIOD, PROBES_PER_ROUND

        self.world, self.rng, self.noise_scale, self.exact = world, rng, noise_scale, exact
        self.load = median_kept_load() if median_kept else PeerLoad(clock=lambda: world.time)
        self.period = PROBE_PERIOD
        self.per_round, self.first_per_period = probes or (PROBES_PER_ROUND, FIRST_PROBES_PER_PERIOD)
        if probe_all:
            self.per_round = self.first_per_period = 10**9
        self.probed: dict[str, float] = {}
        self.next_round, self.first_left = 0.0, self.first_per_period

    def probe_due(self) -> None:
        """A round of probes when a period has passed (probes.RoundTripProbes._probe_every_period)."""
        now, truth = self.world.time, self.world.truth()
        if now < self.next_round:
            return
        self.next_round, self.first_left = now + self.period, self.first_per_period
        for gone in [peer for peer in self.probed if peer not in truth]:
            del self.probed[gone]
        due = sorted((peer for peer, when in self.probed.items() if now - when >= self.period * 0.9),
                     key=self.probed.__getitem__)[:self.per_round]
        for peer in due + self._first_probes(truth):
            self._probe(peer, truth)

    def _first_probes(self, truth) -> list[str]:
        new = [peer for peer in truth if peer not in self.probed]
        chosen = self.rng.sample(new, min(self.first_left, len(new)))
        self.first_left -= len(chosen)
        return chosen

    def _probe(self, peer: str, truth) -> None:
        self.probed[peer] = self.world.time
        self.load.round_trip(peer, truth[peer].client_rtt * noise(self.rng, self.noise_scale))

    def route(self, judged: Judged, judge: bool) -> list:
        """A chain as SwarmClient.chain chooses it (first probes of new servers begun first: measure_new)."""
        from swarm.client.routing import choose_chain

        truth = self.world.truth()
        for peer in self._first_probes(truth):
            self._probe(peer, truth)
        servers, factors = self.world.remote_servers(), self.load.factors()
        measured, rtt = self.load.measured(), self.load.round_trips()
        if self.exact:
            measured = {peer: server.seconds_per_block for peer, server in truth.items()}
            rtt = {peer: server.client_rtt for peer, server in truth.items()}
        began = time.perf_counter()
        chain = choose_chain(servers, self.world.blocks, "simulated", load=factors, measured=measured, rtt=rtt,
                             flowing=True)
        judged.route_seconds.append(time.perf_counter() - began)
        if judge:
            best = best_seconds(truth, self.world.blocks, factors)
            judged.ratios.append(chain_seconds(chain, truth, factors) / best)
            judged.measured_share.append(sum(link.peer_id in measured for link in chain) / len(chain))
        return chain

    def step(self, chain: list) -> None:
        """One decode step through `chain`: what the gateway measures of each hop (flowing.py's lag: the
        server's round trip from the gateway plus its compute, each with this machine's noise)."""
        truth = self.world.truth()
        for link in chain:
            server, blocks = truth[link.peer_id], link.end - link.start
            lag = (server.client_rtt * noise(self.rng, self.noise_scale)
                   + blocks * server.seconds_per_block * noise(self.rng, self.noise_scale))
            self.load.observed(link.peer_id, lag, blocks)


def simulate(options, variant: str) -> Judged:
    """One run of the world and the gateway, a tick a second; the choices after the warm-up judged."""
    from swarm.client import flowing_routes

    settings = dict(VARIANTS[variant])
    link_share, today_share = settings.pop("link_share", None), flowing_routes.UNANNOUNCED_LINK_SHARE
    world = World(options.servers, options.blocks, options.seed,
                  0.0 if settings.pop("no_noise", False) else options.noise, options.churn_every)
    gateway = SimulatedGateway(world, random.Random(options.seed + 1), world.noise_scale, **settings)
    try:
        flowing_routes.UNANNOUNCED_LINK_SHARE = link_share or today_share
        return _run(options, world, gateway)
    finally:
        flowing_routes.UNANNOUNCED_LINK_SHARE = today_share


def _run(options, world: World, gateway: SimulatedGateway) -> Judged:
    judged, sessions, owed = Judged(), [], 0.0
    while world.time < options.warmup + options.seconds:
        judge = world.time >= options.warmup
        gateway.probe_due()
        live = world.truth()
        for session in sessions:
            if any(link.peer_id not in live for link in session.chain):  # a server left: a failover
                _open(gateway, session.chain, -1)
                session.chain = gateway.route(judged, judge)
                _open(gateway, session.chain, 1)
            gateway.step(session.chain)
            session.steps_left -= 1
        for session in [session for session in sessions if session.steps_left <= 0]:
            _open(gateway, session.chain, -1)
            sessions.remove(session)
        owed += options.sessions_per_second
        while owed >= 1:
            owed -= 1
            sessions.append(Session(gateway.route(judged, judge), options.session_steps))
            _open(gateway, sessions[-1].chain, 1)
        world.advance(1.0)
    return judged


def _open(gateway: SimulatedGateway, chain: list, change: int) -> None:
    for link in chain:
        gateway.load.opened(link.peer_id, change)


def summary(variant: str, judged: Judged) -> dict:
    ratios = sorted(judged.ratios)
    if not ratios:
        return {"variant": variant, "choices": 0}
    return {"variant": variant, "choices": len(ratios),
            "within_10_percent": sum(ratio <= 1.1 for ratio in ratios) / len(ratios),
            "median": statistics.median(ratios), "p90": ratios[int(0.9 * (len(ratios) - 1))], "max": ratios[-1],
            "measured_share": statistics.mean(judged.measured_share),
            "route_ms": statistics.median(judged.route_seconds) * 1e3}


def parse_options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.routing_quality", description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=1000, help="simulated servers, kept by churn (1000)")
    parser.add_argument("--blocks", type=int, default=80, help="the model's blocks (80)")
    parser.add_argument("--seconds", type=float, default=120.0, help="simulated seconds judged (120)")
    parser.add_argument("--warmup", type=float, default=60.0, help="simulated seconds before judging (60)")
    parser.add_argument("--sessions-per-second", type=float, default=2.0, help="sessions opened a second (2)")
    parser.add_argument("--session-steps", type=int, default=20, help="decode steps of a session, one a second (20)")
    parser.add_argument("--churn-every", type=float, default=3.0, help="seconds between a leave and a join (3)")
    parser.add_argument("--noise", type=float, default=1.0,
                        help="this machine's timing noise on every measurement, scaled (1; 0: exact)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)} (all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every figure here")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    options = parse_options(argv)
    print("| variant | choices judged | within 10% of the best | median ratio | p90 | max "
          "| chain servers measured | choose_chain ms |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    results = []
    for variant in options.variants.split(","):
        figures = summary(variant, simulate(options, variant))
        results.append(figures)
        if figures["choices"]:
            print(f"| {variant} | {figures['choices']} | {figures['within_10_percent']:.0%} | {figures['median']:.3f} "
                  f"| {figures['p90']:.3f} | {figures['max']:.2f} | {figures['measured_share']:.0%} "
                  f"| {figures['route_ms']:.1f} |", flush=True)
    if options.json:
        with open(options.json, "w") as file:
            json.dump({"options": vars(options), "results": results}, file, indent=1)
    return results


if __name__ == "__main__":
    main()
