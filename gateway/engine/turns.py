"""Which ready sessions step now, once the engine loop is saturated: the loop shared between clients, not sessions.

A tick starts the step of every session that is ready, up to a bound of steps in flight; past it the loop is
saturated, and the sessions left over wait here until steps come back. The bound is ENGINE_MAX_STEPS, or by default
found from the steps themselves: while a step's round trip does not grow with the steps in flight beside it (a GPU's
rounds, a small model's) there is none, every session steps each tick; once it does (the servers' rounds are
compute-bound), the bound is the fewest steps in flight that keep 90% of the most tokens a second the loop could
carry, so that one client's many sessions no longer make everyone's steps slow for little more throughput.

Taken in turn by session, one client's sixteen sessions would get sixteen of every seventeen steps beside another
client's one. So by default (ENGINE_SHARING=client) the steps in flight are shared between clients
(access.client_id, a session's owner): the waiting client with the fewest steps in flight goes next, the oldest
waiting session of its own first. A client whose sessions cannot use its part (one session: one step at a time)
leaves the rest to the others, so the loop never idles while anyone waits. ENGINE_SHARING=session shares them
between sessions instead.

    loop --add(ready sequences)--> waiting, per client, oldest first --take()--> the steps to start now
    loop --flew(sequences)/landed(sequence)--> steps in flight, per client, and what they cost (the loop's thread)
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Hashable, Iterable, Optional

from gateway.engine.speculation import StepCosts

THROUGHPUT_KEPT = 0.9  # a found bound keeps this share of the loop's most tokens a second
FEWEST_FOUND = 8  # a found bound is never lower: a few sessions always step together
ROUND_SAMPLES = 256  # recent steps the bound is found from


@dataclass(frozen=True)
class Sharing:
    """`max_steps`: steps in flight at once past which sessions take turns (0: found from the steps' round trips);
    `by`: "client" or "session", what gets an equal part of them (ENGINE_MAX_STEPS and ENGINE_SHARING, checked by
    config.Limits)."""

    max_steps: int = 0
    by: str = "client"


def found_bound(costs: StepCosts) -> Optional[int]:
    """The fewest steps in flight that carry THROUGHPUT_KEPT of the most tokens a second, from a line of a step's
    round trip by steps in flight (seconds = base + per_step x n: n / seconds nears 1 / per_step, and is at
    THROUGHPUT_KEPT of it at n = k / (1 - k) x base / per_step); None while round trips do not grow with it."""
    line = costs.line()
    if line is None or line[1] <= line[0] * 1e-3:  # no steps of two sizes yet, or a step more costs ~nothing
        return None
    base, per_step = line
    return max(FEWEST_FOUND, math.ceil(round(THROUGHPUT_KEPT / (1 - THROUGHPUT_KEPT) * base / per_step, 6)))


class Turns:
    """The loop's waiting sequences and its steps in flight, by who shares them."""

    def __init__(self, sharing: Sharing = Sharing()):
        self.sharing = sharing
        self._waiting: dict[Hashable, deque] = {}  # by share; the order is whose turn comes first on a tie
        self._flying: Counter = Counter()  # steps in flight, by share
        self._flown: dict = {}  # sequence -> (when its step left, the steps in flight then)
        self.costs = StepCosts(guess=False, samples=ROUND_SAMPLES)  # round trips by steps in flight

    def bound(self) -> Optional[int]:
        """The most steps in flight at once, or None for no bound (see the module's docstring)."""
        return self.sharing.max_steps or found_bound(self.costs)

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    def share_of(self, sequence) -> Hashable:
        session = sequence.session
        return session.owner if self.sharing.by == "client" else session.id

    def add(self, sequences: Iterable) -> None:
        for sequence in sequences:
            self._waiting.setdefault(self.share_of(sequence), deque()).append(sequence)

    def discard(self, sequence) -> None:
        """It ended while waiting (an abort, a failure): it never steps."""
        share = self.share_of(sequence)
        queue = self._waiting.get(share)
        if queue is not None and sequence in queue:
            queue.remove(sequence)
            if not queue:
                del self._waiting[share]

    def take(self) -> list:
        """The waiting sequences to step now, as many as the steps in flight leave room for."""
        most = self.bound()
        room = most - self._flying.total() if most else len(self)
        if room >= len(self):  # not saturated: every one of them
            taken = [sequence for queue in self._waiting.values() for sequence in queue]
            self._waiting.clear()
            return taken
        taken: list = []
        chosen: Counter = Counter()  # this call's, on top of those in flight
        while room > 0 and self._waiting:
            share = min(self._waiting, key=lambda key: self._flying[key] + chosen[key])  # the first on a tie
            queue = self._waiting.pop(share)
            taken.append(queue.popleft())
            chosen[share] += 1
            room -= 1
            if queue:
                self._waiting[share] = queue  # back of the order: the next tie goes to another
        return taken

    def flew(self, sequences: list) -> None:
        """Their steps left together: each is counted in flight, with how many were then (its round trip's load)."""
        for sequence in sequences:
            self._flying[self.share_of(sequence)] += 1
        left, in_flight = time.perf_counter(), self._flying.total()
        for sequence in sequences:
            self._flown[sequence] = (left, in_flight)

    def landed(self, sequence) -> None:
        left, in_flight = self._flown.pop(sequence, (None, 0))
        if left is not None:
            self.costs.observed(in_flight, time.perf_counter() - left)
        share = self.share_of(sequence)
        self._flying[share] -= 1
        if self._flying[share] <= 0:
            del self._flying[share]
