"""What every process of a run did over a measured window (one concurrency run): each block server's rounds,
the CPU time of every process per generated token, and the GPU's utilisation. Issue 31's figures: a server
should fill its rounds (rows per round), replay graphs in steady decoding (no eager round but prefill chunks)
and spend little CPU on each token.

    rows per round   each server's swarm_server_batch_size histogram (sequences per forward round): the
                     difference of its _sum over the difference of its _count, between a scrape of the server's
                     /metrics (--metrics-port: MeteredSwarm starts them so) before the window and one after
    graphed rounds   swarm_server_graph_rounds_total, the same way
    eager rounds     swarm_server_eager_rounds_total, per `reason` (prefill, no graphs, size, ...)
    CPU ms/token     psutil's user + system CPU time of each process (the gateway, each server, the bootstrap
                     peer), its libp2p daemon (p2pd) apart, before and after, over the tokens the window generated
    GPU busy         nvidia-smi's utilization.gpu, sampled on a thread of its own while the window lasts

A metric a server does not export (an older server) is not reported: None in the results, "-" in the table,
never a made-up 0. The same parsing reads this process's own registry, for bench/span_round.py's rounds.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import threading
from dataclasses import dataclass
from typing import Iterable, Optional

from swarm.local import ChildProcess, LocalSwarm

BATCH_SIZE = "swarm_server_batch_size"
GRAPH_ROUNDS = "swarm_server_graph_rounds_total"
EAGER_ROUNDS = "swarm_server_eager_rounds_total"
GPU_SAMPLE_SECONDS = 0.25  # nvidia-smi takes some 50 ms a call: four samples a second cost little of a CPU
GPU_QUERY = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]


# ------------------------------------------------------------------------------------------- server rounds


@dataclass(frozen=True)
class RoundCounters:
    """A server's round counters at one moment (or their growth over a window)."""

    rows: Optional[float] = None  # swarm_server_batch_size_sum: sequences summed over rounds
    rounds: Optional[float] = None  # swarm_server_batch_size_count: forward rounds
    graph_rounds: Optional[float] = None  # rounds that replayed a graph
    eager_rounds: Optional[dict[str, float]] = None  # rounds run eagerly, by reason

    def since(self, earlier: "RoundCounters") -> "RoundCounters":
        """The growth from `earlier` to this one; what either lacks stays unreported."""
        def grown(now: Optional[float], then: Optional[float]) -> Optional[float]:
            return None if now is None or then is None else now - then

        eager = None
        if self.eager_rounds is not None and earlier.eager_rounds is not None:
            eager = {reason: count - earlier.eager_rounds.get(reason, 0.0)
                     for reason, count in self.eager_rounds.items()}
            eager = {reason: count for reason, count in eager.items() if count}
        return RoundCounters(grown(self.rows, earlier.rows), grown(self.rounds, earlier.rounds),
                             grown(self.graph_rounds, earlier.graph_rounds), eager)


def round_counters(families: Iterable) -> RoundCounters:
    """RoundCounters from prometheus_client metric families: a server's /metrics text parsed, or metric objects'
    collect(). Matched by sample name, so that a counter's _created sample and every other metric pass by."""
    found: dict = {}
    for family in families:
        for sample in family.samples:
            if sample.name == BATCH_SIZE + "_sum":
                found["rows"] = sample.value
            elif sample.name == BATCH_SIZE + "_count":
                found["rounds"] = sample.value
            elif sample.name == GRAPH_ROUNDS:
                found["graph_rounds"] = found.get("graph_rounds", 0.0) + sample.value
            elif sample.name == EAGER_ROUNDS:
                eager = found.setdefault("eager_rounds", {})
                reason = sample.labels.get("reason", "")
                eager[reason] = eager.get(reason, 0.0) + sample.value
    return RoundCounters(**found)


def parse_metrics(text: str) -> RoundCounters:
    from prometheus_client.parser import text_string_to_metric_families

    return round_counters(text_string_to_metric_families(text))


def scrape(url: str, timeout: float = 10.0) -> Optional[RoundCounters]:
    """A server's counters now; None when its /metrics does not answer."""
    import requests

    try:
        return parse_metrics(requests.get(url, timeout=timeout).text)
    except (requests.RequestException, ValueError):
        return None


def server_window(before: Optional[RoundCounters], after: Optional[RoundCounters]) -> dict:
    """One server's rounds over a window: how many, rows per round, graphed and eager (by reason)."""
    grown = after.since(before) if before is not None and after is not None else RoundCounters()
    rows_per_round = grown.rows / grown.rounds if grown.rows is not None and grown.rounds else math.nan
    return {"rounds": grown.rounds, "rows_per_round": rows_per_round, "graph_rounds": grown.graph_rounds,
            "eager_rounds": grown.eager_rounds}


# ------------------------------------------------------------------------------------------- CPU time


def cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU seconds of a process and its descendants: `own` (it and its other children: a gunicorn
    master's worker) and `p2pd` (its libp2p daemons). A process gone meanwhile counts nothing."""
    import psutil

    found = {"own": 0.0, "p2pd": 0.0}
    try:
        processes = [psutil.Process(pid)]
        processes += processes[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for process in processes:
        try:
            times, name = process.cpu_times(), process.name()
        except psutil.NoSuchProcess:
            continue
        found["p2pd" if name.startswith("p2pd") else "own"] += times.user + times.system
    return found


def cpu_ms_per_token(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    """Milliseconds of CPU per generated token, by part (own, p2pd), over a window; NaN without tokens."""
    return {part: max(after.get(part, 0.0) - spent, 0.0) * 1000 / tokens if tokens else math.nan
            for part, spent in before.items()}


# ------------------------------------------------------------------------------------------- GPU utilisation


def gpu_busy_percent() -> Optional[float]:
    """nvidia-smi's utilization.gpu now, the mean over the GPUs it lists; None where it cannot say."""
    try:
        listing = subprocess.run(GPU_QUERY, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    values = [float(line) for line in (line.strip() for line in listing.splitlines()) if _number(line)]
    return sum(values) / len(values) if values else None


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class GpuSampler:
    """GPU utilisation sampled every `period` seconds on a daemon thread, from start() to stop()."""

    def __init__(self, period: float = GPU_SAMPLE_SECONDS, query=gpu_busy_percent):
        self.period, self.query, self.samples = period, query, []
        self._stopped, self._thread = threading.Event(), None

    def start(self) -> "GpuSampler":
        self._thread = threading.Thread(target=self._sample, name="gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stopped.is_set():
            value = self.query()
            if value is None:
                return  # no nvidia-smi, or none that answers: nothing to report
            self.samples.append(value)
            self._stopped.wait(self.period)

    def stop(self) -> Optional[dict]:
        """The mean and peak utilisation in percent, and how many samples; None without any."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
        if not self.samples:
            return None
        return {"mean_percent": sum(self.samples) / len(self.samples), "max_percent": max(self.samples),
                "samples": len(self.samples)}


# ------------------------------------------------------------------------------------------- a window


@dataclass(frozen=True)
class Watched:
    """What a window watches: servers' metrics URLs and every process, by the name the report gives them."""

    servers: dict[str, str]  # e.g. "server 0:15" -> http://127.0.0.1:PORT/metrics
    processes: dict[str, int]  # e.g. "gateway", "server 0:15", "dht" -> its pid
    gpu: bool  # sample the GPU's utilisation (a CUDA run with nvidia-smi)


class UsageWindow:
    """`with UsageWindow(watched) as window: <run>`, then window.result(tokens the run generated)."""

    def __init__(self, watched: Watched):
        self.watched = watched
        self.metrics: dict[str, list[Optional[RoundCounters]]] = {}  # server -> [before, after]
        self.cpu: dict[str, list[dict[str, float]]] = {}  # process -> [before, after]
        self.gpu: Optional[GpuSampler] = None
        self.gpu_result: Optional[dict] = None

    def __enter__(self) -> "UsageWindow":
        self.metrics = {name: [scrape(url)] for name, url in self.watched.servers.items()}
        self.cpu = {name: [cpu_seconds(pid)] for name, pid in self.watched.processes.items()}
        if self.watched.gpu and shutil.which(GPU_QUERY[0]):
            self.gpu = GpuSampler().start()
        return self

    def __exit__(self, *exc_info) -> None:
        for name, url in self.watched.servers.items():
            self.metrics[name].append(scrape(url))
        for name, pid in self.watched.processes.items():
            self.cpu[name].append(cpu_seconds(pid))
        self.gpu_result = self.gpu.stop() if self.gpu is not None else None

    def result(self, tokens: int) -> dict:
        return {
            "tokens": tokens,
            "servers": {name: server_window(*scrapes) for name, scrapes in self.metrics.items()},
            "cpu_ms_per_token": {name: cpu_ms_per_token(*times, tokens) for name, times in self.cpu.items()},
            "gpu_utilisation": self.gpu_result,  # None: not on a GPU, or no nvidia-smi
        }


class MeteredSwarm(LocalSwarm):
    """A LocalSwarm whose block servers serve their Prometheus metrics (--metrics-port), each on a free port:
    metrics_urls[i] is servers[i]'s."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.metrics_urls: list[str] = []

    def add_server(self, args, wait: bool = True) -> ChildProcess:
        from bench.gateway import free_port

        port = free_port()
        self.metrics_urls.append(f"http://127.0.0.1:{port}/metrics")
        return super().add_server([*args, "--metrics-port", str(port)], wait)


def watch(swarm: MeteredSwarm, gateway_pid: int, gpu: bool) -> Watched:
    """Every server of the swarm (named by its blocks), the gateway and the bootstrap peer."""
    names = [f"server {start}:{end}" for start, end in swarm.spans]
    processes = {"gateway": gateway_pid, **{name: server.process.pid for name, server in zip(names, swarm.servers)}}
    if swarm.bootstrap is not None:
        processes["dht"] = swarm.bootstrap.process.pid
    return Watched(dict(zip(names, swarm.metrics_urls)), processes, gpu)
