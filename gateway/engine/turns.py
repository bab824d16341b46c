"""Which ready sessions step now, once the engine loop is saturated: the loop shared between clients, not sessions.

A tick starts the step of every session that is ready, up to ENGINE_MAX_STEPS steps in flight (0, the default: no
bound); past it the loop is saturated, and the sessions left over wait here until steps come back. A bound trades
throughput for the share of a client with few sessions, not for its speed: measured on the default model
(bench/fairness.py: 16 sessions of one client beside one of another's, two CPU servers), a bound of 8 raised the
lone client's share of the tokens from 6% to 14%, its steps as slow as before (about 140 ms a token), for 44% of
the first client's throughput (95 to 53 tok/s). So none is set by default; an operator who wants turns chooses it.

Taken in turn by session, one client's sixteen sessions would get sixteen of every seventeen steps beside another
client's one. So by default (ENGINE_SHARING=client) the steps in flight are shared between clients
(access.client_id, a session's owner): the waiting client with the fewest steps in flight goes next, the oldest
waiting session of its own first. A client whose sessions cannot use its part (one session: one step at a time)
leaves the rest to the others, so the loop never idles while anyone waits. ENGINE_SHARING=session shares them
between sessions instead.

    loop --add(ready sequences)--> waiting, per client, oldest first --take()--> the steps to start now
    loop --flew(sequences)/landed(sequence)--> steps in flight, per client (all on the loop's thread)
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Hashable, Iterable


@dataclass(frozen=True)
class Sharing:
    """`max_steps`: steps in flight at once past which sessions take turns (0: never); `by`: "client" or "session",
    what gets an equal part of them (ENGINE_MAX_STEPS and ENGINE_SHARING, checked by config.Limits)."""

    max_steps: int = 0
    by: str = "client"


class Turns:
    """The loop's waiting sequences and its steps in flight, by who shares them."""

    def __init__(self, sharing: Sharing = Sharing()):
        self.sharing = sharing
        self._waiting: dict[Hashable, deque] = {}  # by share; the order is whose turn comes first on a tie
        self._flying: Counter = Counter()  # steps in flight, by share

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
        most = self.sharing.max_steps
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
        """Their steps left: each is counted in flight."""
        for sequence in sequences:
            self._flying[self.share_of(sequence)] += 1

    def landed(self, sequence) -> None:
        share = self.share_of(sequence)
        self._flying[share] -= 1
        if self._flying[share] <= 0:
            del self._flying[share]
