"""The churn itself: every few seconds a server leaves (SIGTERM or kill -9) or joins (a new one, or one that left
coming back with the same identity), in a fixed cycle, never leaving a block without a live server."""

from __future__ import annotations

import random
import threading
from pathlib import Path

from bench.churn.fleet import Fleet, FleetEvent, ServerPlan, cover, plan_spans

CYCLE = ("sigterm", "rejoin", "kill", "join")


class Churner:
    """Runs the cycle on a thread of its own from `start()` to `stop()`. That thread starts the joining servers,
    and the kernel ties a child's death signal to the thread that started it (swarm.local): so it lives on,
    idle, until `close()`, which comes after the fleet has stopped."""

    def __init__(self, fleet: Fleet, every: float, target_servers: int, num_blocks: int, latency: tuple[float, float],
                 identities: Path, rng: random.Random):
        self.fleet, self.every, self.target, self.num_blocks = fleet, every, target_servers, num_blocks
        self.latency, self.identities, self.rng = latency, identities, rng
        self.stopping, self.closing = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="churn", daemon=True)
        self.acting = threading.Lock()
        self.skipped = 0  # turns that could not act without leaving a block unserved, or past the population bounds

    def start(self) -> "Churner":
        self.thread.start()
        return self

    def stop(self) -> None:
        """No more churn (the event under way, if any, is finished first)."""
        self.stopping.set()
        self.acting.acquire()
        self.acting.release()

    def close(self) -> None:
        self.stop()
        self.closing.set()
        if self.thread.is_alive():
            self.thread.join()

    def _run(self) -> None:
        turn = 0
        while not self.stopping.wait(self.every):
            with self.acting:
                if self.stopping.is_set():
                    break
                if self.act(CYCLE[turn % len(CYCLE)]) is None:
                    self.skipped += 1
            turn += 1
        self.closing.wait()

    def act(self, action: str):
        """One churn event, or None when it would leave a block unserved or the population out of bounds."""
        live = len(self.fleet.live)
        if action in ("sigterm", "kill"):
            if live <= self.target - 2:
                return None
            name = self._leaver()
            return None if name is None else self.fleet.leave(name, action)
        if live >= self.target + 2:
            return None
        if action == "rejoin" and self.fleet.stopped:
            return self.fleet.start(self.fleet.plans[self.fleet.stopped[0]], "rejoin")
        return self._join_new()

    def _leaver(self):
        """A random live, ready server whose blocks all stay held by at least one other ready server."""
        candidates = sorted(self.fleet.ready)
        self.rng.shuffle(candidates)
        for name in candidates:
            if min(cover(self.fleet.serving_spans(excluding=name), self.num_blocks)) >= 1:
                return name
        return None

    def _join_new(self) -> FleetEvent:
        number = len(self.fleet.plans)
        (start, end), = plan_spans(1, self.num_blocks, 0, self.rng)
        latency_ms = round(self.rng.uniform(*self.latency))
        plan = ServerPlan(f"server{number}", start, end, latency_ms, self.identities / f"server{number}.key")
        return self.fleet.start(plan, "join")
