"""Where a step's time goes: each stage a step passes through adds its duration here, as it passes.

    gateway tick ──handoff──> client's event loop ──queue──> message sent ──wire──> server: decode, queue, compute,
    reply (the server's own clock, carried back in the reply's metadata) ──> outputs delivered ──wake──> next tick

The gateway's engine loop, the client's step channels and each server's timings (swarm/server/timings.py, in its
replies' metadata) add to one StageClock per process: a sum of seconds and a count per (stage, blocks), "blocks" naming
the hop for the stages of one server ("" for the others). Adding costs two dict updates under a lock; nothing
is computed per step beyond that. /metrics exposes the sums (`swarm_step_stage_seconds_total`, `swarm_step_stage_events_total`),
and `python -m bench.engine` prints their means per step, side by side with each process's CPU.

Stages are added from several threads (the engine loop's, the client's event loop's, the readers'): an
uncontended lock per addition costs a fraction of a microsecond.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

now = time.perf_counter  # every stage's clock: monotonic, sub-microsecond


class StageClock:
    def __init__(self):
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.events: dict[tuple[str, str], int] = defaultdict(int)
        self._lock = threading.Lock()

    def add(self, stage: str, seconds: float, events: int = 1, blocks: str = "") -> None:
        """`events` steps (or messages) spent `seconds` each in `stage`."""
        key = (stage, blocks)
        with self._lock:
            self.seconds[key] += seconds * events
            self.events[key] += events

    def add_server_timings(self, timings, blocks: str, events: int) -> None:
        """A reply's "timings" (the server's own durations for the message: decode, queue, compute, reply,
        total), ignored unless well formed: a server is free not to send them, and may send anything."""
        if not isinstance(timings, dict):
            return
        for stage, seconds in timings.items():
            if stage in SERVER_STAGES and isinstance(seconds, float) and 0.0 <= seconds < 3600.0:
                self.add("server_" + stage, seconds, events, blocks)

    def snapshot(self) -> dict[tuple[str, str], tuple[float, int]]:
        with self._lock:
            return {key: (self.seconds[key], self.events[key]) for key in self.seconds}

    def collect(self):
        """prometheus_client's custom collector interface: the sums as two counters."""
        from prometheus_client.core import CounterMetricFamily

        seconds = CounterMetricFamily("swarm_step_stage_seconds", "Seconds steps spent in each stage (see "
                                      "swarm/client/stage_clock.py), by stage and the hop's blocks",
                                      labels=["stage", "blocks"])
        events = CounterMetricFamily("swarm_step_stage_events", "Steps (or messages) that passed each stage",
                                     labels=["stage", "blocks"])
        for (stage, blocks), (total, count) in self.snapshot().items():
            seconds.add_metric([stage, blocks], total)
            events.add_metric([stage, blocks], count)
        yield seconds
        yield events


SERVER_STAGES = frozenset({"decode", "queue", "compute", "reply", "total"})
CLOCK = StageClock()  # the process's: every client and engine loop in it adds here


_exposed = []


def expose() -> None:
    """Expose CLOCK at /metrics, once per process (the gateway's engine does it when it starts a loop)."""
    from prometheus_client import REGISTRY

    if not _exposed:
        REGISTRY.register(CLOCK)
        _exposed.append(CLOCK)
