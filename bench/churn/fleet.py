"""The churn harness's block servers: each with its own span, simulated latency and identity, started, stopped
(SIGTERM), killed (SIGKILL) and started again with the same identity, or joined anew, while sessions run.

A server's plan (span, latency, key file) outlives its process, so that a rejoin is the same peer id on the same
span at the same distance. Joins are not waited on: a watcher thread records when the server said it was ready
(or that it failed), as an operator would see it.
"""

from __future__ import annotations

import random
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from swarm.local import ChildProcess, LocalSwarmError

SPAN_LENGTHS = (4, 6, 8, 12)
JOIN_TIMEOUT = 180.0


@dataclass(frozen=True)
class ServerPlan:
    name: str
    start: int
    end: int
    latency_ms: float  # --simulated-latency: the round trip this server adds per hop
    identity: Path  # --identity: a rejoin keeps its peer id


@dataclass
class FleetEvent:
    at: float  # seconds since the harness began
    action: str  # start, join, rejoin, sigterm, kill
    server: str
    outcome: str = "done"  # done; for a start or join: ready, failed (with why) or pending
    ready_after: Optional[float] = None  # seconds from its start to its "ready:" line
    detail: str = ""


def plan_spans(count: int, num_blocks: int, min_cover: int, rng: random.Random) -> list[tuple[int, int]]:
    """`count` spans of varied lengths and offsets that hold every block at least `min_cover` times: many
    chains of 2 to 6 hops cover the model, so routing has a choice to make."""
    for _ in range(1000):
        spans = []
        for _ in range(count):
            length = min(rng.choice(SPAN_LENGTHS), num_blocks)
            start = rng.randrange(0, num_blocks - length + 1)
            spans.append((start, start + length))
        if min(cover(spans, num_blocks)) >= min_cover:
            return spans
    raise ValueError(f"{count} servers cannot hold {num_blocks} blocks {min_cover} times each; add servers")


def cover(spans: Sequence[tuple[int, int]], num_blocks: int) -> list[int]:
    """How many of the spans hold each block."""
    return [sum(start <= block < end for start, end in spans) for block in range(num_blocks)]


def seconds_per_block(ready_line: str, blocks: int) -> float:
    """A decode step's compute per block on a server, from the throughput its "ready:" line says it measured
    (tokens/s through its whole span)."""
    match = re.search(r", ([0-9.]+) tokens/s", ready_line)
    throughput = float(match.group(1)) if match else 0.0
    return 1.0 / (throughput * blocks) if throughput > 0 else 0.0


def plan_latencies(count: int, latency_ms: float, spread: float, rng: random.Random) -> list[float]:
    """Each server's round trip: uniform within latency_ms x (1 +- spread), whole milliseconds."""
    return [round(latency_ms * rng.uniform(1 - spread, 1 + spread)) for _ in range(count)]


@dataclass
class Fleet:
    """The live block servers of one harness run, and every event that happened to them."""

    model: str
    initial_peers: list[str]
    log_dir: Path
    server_args: list[str]  # for every server: threads...
    jitter_ms: float = 0.0  # --simulated-latency-jitter of every server with a round trip
    seed: int = 0
    began: float = field(default_factory=time.monotonic)
    wall_began: float = field(default_factory=time.time)  # the same moment on the gateways' log clock
    live: dict[str, ChildProcess] = field(default_factory=dict)
    plans: dict[str, ServerPlan] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)  # names whose process is gone: may rejoin
    events: list[FleetEvent] = field(default_factory=list)
    peer_ids: dict[str, str] = field(default_factory=dict)  # name -> peer id, once ready (kept after it leaves)
    ready: set[str] = field(default_factory=set)  # names of the live servers that said they are ready
    seconds_per_block: dict[str, float] = field(default_factory=dict)  # name -> from the throughput it measured
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, plan: ServerPlan, action: str = "start") -> FleetEvent:
        """Start a server of `plan`; its readiness is recorded in the returned event when it comes."""
        args = ["-m", "swarm.server", "--model", self.model, "--blocks", f"{plan.start}:{plan.end}",
                "--identity", str(plan.identity), *self.latency_args(plan), *self.server_args,
                "--initial-peers", *self.initial_peers]
        event = FleetEvent(self.now(), action, plan.name, outcome="pending")
        with self.lock:
            self.plans[plan.name] = plan
            if plan.name in self.stopped:
                self.stopped.remove(plan.name)
            process = ChildProcess(f"{plan.name}-{len(self.events)}", args, self.log_dir)
            self.live[plan.name] = process
            self.events.append(event)
        threading.Thread(target=self._watch_ready, args=(process, event), daemon=True).start()
        return event

    def latency_args(self, plan: ServerPlan) -> list[str]:
        """The server's simulated round trip and jitter (none when 0: off unless asked, as on a real server), with
        a seed of its own, so that each server's spread is repeatable and unlike the others'."""
        if not plan.latency_ms:
            return []
        jitter = ["--simulated-latency-jitter", str(self.jitter_ms)] if self.jitter_ms else []
        seed = self.seed * 1000 + int(plan.name.removeprefix("server"))
        return ["--simulated-latency", str(plan.latency_ms), *jitter, "--simulated-latency-seed", str(seed)]

    def _watch_ready(self, process: ChildProcess, event: FleetEvent) -> None:
        try:
            process.ready_line = process.wait_for_line(lambda line: line.startswith("ready:"), JOIN_TIMEOUT)
        except LocalSwarmError as error:
            event.outcome, event.detail = "failed", str(error).splitlines()[0][:300]
            return
        event.outcome, event.ready_after = "ready", round(self.now() - event.at, 2)
        plan = self.plans[event.server]
        with self.lock:
            self.peer_ids[event.server] = process.peer_id
            self.seconds_per_block[event.server] = seconds_per_block(process.ready_line, plan.end - plan.start)
            if self.live.get(event.server) is process:
                self.ready.add(event.server)

    def wait_ready(self, timeout: float = JOIN_TIMEOUT) -> None:
        """Until every pending start has ended (ready or failed); raise if any failed."""
        deadline = time.monotonic() + timeout
        while any(event.outcome == "pending" for event in self.events) and time.monotonic() < deadline:
            time.sleep(0.2)
        failed = [event for event in self.events if event.outcome != "ready"]
        if failed:
            raise LocalSwarmError(f"{failed[0].server} did not start: {failed[0].detail or failed[0].outcome}")

    def leave(self, name: str, how: str) -> FleetEvent:
        """Stop a live server: `sigterm` (it withdraws its records) or `kill` (SIGKILL: its records linger)."""
        with self.lock:
            process = self.live.pop(name)
            self.ready.discard(name)
            self.stopped.append(name)
            event = FleetEvent(self.now(), how, name)
            self.events.append(event)
        process.process.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        threading.Thread(target=process.stop, daemon=True).start()  # reaps it (a SIGTERM'd one gets 10 s)
        return event

    def serving_spans(self, excluding: str = "") -> list[tuple[int, int]]:
        """The spans of the live servers that are ready (one still starting serves nothing yet)."""
        with self.lock:
            return [(self.plans[name].start, self.plans[name].end) for name in self.live
                    if name != excluding and name in self.ready]

    def live_runs(self) -> list[tuple[str, float, float]]:
        """(server name, ready at, gone at) of every run of every server, in seconds since the fleet began
        (gone at: inf while it runs). A run that never became ready is none."""
        runs, since = [], {}
        for event in sorted(self.events, key=lambda event: event.at):
            if event.outcome == "ready":
                since[event.server] = event.at + event.ready_after
            elif event.action in ("sigterm", "kill") and event.server in since:
                runs.append((event.server, since.pop(event.server), event.at))
        return runs + [(name, ready, float("inf")) for name, ready in since.items()]

    def now(self) -> float:
        return round(time.monotonic() - self.began, 2)

    def stop(self) -> None:
        with self.lock:
            processes = list(self.live.values())
            self.live.clear()
        for process in processes:  # all at once: each withdraws its records while the DHT is still up
            process.terminate()
        for process in processes:
            process.stop()
