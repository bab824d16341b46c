"""One churn run, in order: the model and its local replies, the bootstrap peer, the servers, two gateways, then
churn and sessions together for --duration seconds; the gateways' counters and logs are read before everything
stops (on errors and Ctrl-C too)."""

from __future__ import annotations

import argparse
import random
import re
import time
from contextlib import ExitStack
from pathlib import Path

import requests

from bench.churn.chains import LiveServer, judge, read_choices
from bench.churn.churn import Churner
from bench.churn.fleet import Fleet, ServerPlan, plan_latencies, plan_spans
from bench.churn.model import churn_model, reference_replies
from bench.churn.sessions import SessionWorkers
from bench.churn.summary import distribution, summarize
from bench.gateway import Gateway
from swarm.local import ChildProcess, READY_TIMEOUT

GATEWAYS = 2
DRAIN_TIMEOUT = 200.0  # after --duration, the replies under way may take this long to finish
METRICS = ("swarm_client_failovers_total", "swarm_client_retries_total", "swarm_client_failover_causes_total",
           "swarm_client_block_waits_total")


def run_churn(options: argparse.Namespace, log_dir: Path, rng: random.Random) -> dict:
    folder = model_folder(options)
    print(f"local greedy replies of {folder.name} ({options.blocks} blocks)", flush=True)
    replies = reference_replies(folder, options.tokens)
    with ExitStack() as stack:
        bootstrap = ChildProcess("dht", ["-m", "swarm.dht"], log_dir)
        stack.callback(bootstrap.stop)
        initial_peers = bootstrap.wait_for_line(lambda line: "/p2p/" in line, READY_TIMEOUT).split()
        fleet = launch_fleet(options, folder, initial_peers, log_dir, rng)
        churner = new_churner(options, fleet, log_dir, rng)
        stack.callback(churner.close)  # after the fleet has stopped (see Churner)
        stack.callback(fleet.stop)
        # the gateways start beside the servers (each is healthy once the servers cover every block)
        gateways = [new_gateway(options, folder, initial_peers, log_dir, number) for number in range(GATEWAYS)]
        for gateway in gateways:
            stack.callback(gateway.stop)
            gateway.launch()
        fleet.wait_ready()
        for gateway in gateways:
            gateway.wait_healthy()
        print(f"{len(fleet.live)} servers and {GATEWAYS} gateways up after {fleet.now():.0f} s; "
              f"{options.duration:.0f} s of churn and {options.sessions} sessions", flush=True)
        sessions_began = fleet.now()
        churner.start()
        workers = SessionWorkers(options.sessions, [gateway.openai_url for gateway in gateways], folder.name,
                                 replies, options.tokens, fleet.began, time.monotonic() + options.duration).start()
        time.sleep(options.duration)
        churner.stop()
        unfinished = workers.join(DRAIN_TIMEOUT)
        summary = summarize(options, fleet, workers.results, unfinished, [gateway_counters(gateway.url) for gateway
                            in gateways], judge(logged_choices(gateways), live_at(fleet)), churner.skipped,
                            sessions_began)
        measured = [ratio for gateway in gateways for ratio in measured_round_trips(gateway.url, folder.name, fleet)]
        return {**summary, "dht": measure_lookups(initial_peers, folder, options.blocks),
                "round_trips_measured_over_real": distribution(measured)}


def model_folder(options: argparse.Namespace) -> Path:
    """--model's folder (its block count becomes --blocks), or the tiny deep model of --blocks blocks."""
    from config import SwarmSettings
    from swarm.weights import load_config, resolve_model

    cache_dir = SwarmSettings.from_env().cache_dir
    if options.model:
        folder = resolve_model(options.model, cache_dir)
        options.blocks = load_config(folder).num_hidden_layers
        return folder
    return churn_model(cache_dir, options.blocks, resolve_model("SmolLM2-135M-Instruct", cache_dir))


def logged_choices(gateways: list[Gateway]) -> list:
    return [choice for number, gateway in enumerate(gateways)
            for choice in read_choices(gateway.log_dir / "gateway.log", number)]


def launch_fleet(options, folder: Path, initial_peers: list[str], log_dir: Path, rng: random.Random) -> Fleet:
    """The first servers, started (fleet.wait_ready waits for them)."""
    (log_dir / "keys").mkdir()
    fleet = Fleet(str(folder), initial_peers, log_dir, ["--threads", str(options.threads)], options.jitter,
                  options.seed)
    spans = plan_spans(options.servers, options.blocks, 2, rng)
    latencies = plan_latencies(options.servers, options.latency, options.latency_spread, rng)
    try:
        for number, ((start, end), latency) in enumerate(zip(spans, latencies)):
            fleet.start(ServerPlan(f"server{number}", start, end, latency, log_dir / "keys" / f"server{number}.key"))
    except BaseException:
        fleet.stop()
        raise
    return fleet


def new_churner(options, fleet: Fleet, log_dir: Path, rng: random.Random) -> Churner:
    spread = options.latency * options.latency_spread
    return Churner(fleet, options.churn_every, options.servers, options.blocks,
                   (options.latency - spread, options.latency + spread), log_dir / "keys", rng)


def new_gateway(options, folder: Path, initial_peers: list[str], log_dir: Path, number: int) -> Gateway:
    (log_dir / f"gateway{number}").mkdir()
    return Gateway(initial_peers, options.sessions + 8, options.threads, log_dir / f"gateway{number}",
                   model=str(folder), env={"SESSION_STORE": "off"})


def gateway_counters(url: str) -> dict[str, float]:
    """The swarm client's counters on a gateway's /metrics, summed over their labels."""
    totals = dict.fromkeys(METRICS, 0.0)
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        match = re.match(r"^(\w+)(?:\{([^}]*)\})? (\S+)$", line)
        if match and match.group(1) in totals:
            name = match.group(1) if not match.group(2) else f"{match.group(1)}{{{match.group(2)}}}"
            totals[match.group(1)] += float(match.group(3))
            if match.group(2):
                totals[name] = float(match.group(3))
    return totals


def measured_round_trips(url: str, model: str, fleet: Fleet) -> list[float]:
    """Each live server's round trip as the gateway measured it (its /api/v1/swarm), over the real one."""
    real = {fleet.peer_ids[name]: fleet.plans[name].latency_ms for name in fleet.ready}
    listed = requests.get(url + "/api/v1/swarm", params={"model": model}, timeout=60).json()["models"][0]
    return [server["rtt_ms"] / real[server["peer_id"]] for server in listed.get("servers", [])
            if server.get("rtt_ms") is not None and server["peer_id"] in real and real[server["peer_id"]] > 0]


def measure_lookups(initial_peers: list[str], folder: Path, num_blocks: int) -> dict:
    """Routing's DHT lookups on the swarm as churn left it (docs/wan.md scales them to 1,000 servers)."""
    from bench.routing_cost import live_lookups, signed_record_bytes
    from swarm.client import SwarmClient
    from swarm.protocol import dht_prefix

    client = SwarmClient(initial_peers)
    try:
        figures = live_lookups(client, dht_prefix(str(folder)), num_blocks)
    finally:
        client.shutdown()
    record = signed_record_bytes()
    return {**figures, "record_bytes": record, "bytes_per_lookup": int(figures["records_per_lookup"] * record)}


def live_at(fleet: Fleet):
    """time.time() -> the LiveServers then: ready, not yet stopped, with their real round trips, and one compute
    per block for all: every server runs the same blocks on the same cores, so the speeds they measured at
    start differ only by what else was starting then (up to 50x on 2 cores); their median is the real one."""
    runs = fleet.live_runs()
    measured = sorted(fleet.seconds_per_block.values())
    compute = measured[len(measured) // 2] if measured else 0.0

    def servers(at: float) -> list[LiveServer]:
        moment = at - fleet.wall_began
        return [LiveServer(fleet.peer_ids[name], fleet.plans[name].start, fleet.plans[name].end,
                           fleet.plans[name].latency_ms / 1000, compute)
                for name, ready, gone in runs if ready <= moment < gone]
    return servers
