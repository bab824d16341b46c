"""What one step message cost on this server, carried back in its rpc_steps reply (metadata "timings"), so that
a client can tell the server's share of a step's time from the network's.

Seconds on the server's own clock, durations only, rounded to microseconds:

    decode   from the message's arrival in the handler to its steps decoded and checked
    queue    waiting for the compute thread: from its batch submitted to its (first) round started
    compute  its round(s), from the first one started to its last step computed
    reply    from computed (or, with nothing computed, decoded) to the reply built (its tensors serialized)
    total    arrival to the reply built

A few perf_counter calls per message, never per step. The handler opens a message's timings for its task
(`timed_message`); the scheduler's Batch of that task's steps finds them there (`current_timings`) and adds its
wait and its rounds when it settles. A context variable, not a parameter: the message's timings reach its
batches without being threaded through the backend and the step planning, which tests and fault injectors
replace.
"""

from __future__ import annotations

from contextvars import ContextVar
from time import perf_counter
from typing import Optional


class MessageTimings:
    """One message's clock readings; `wire()` makes the reply's map of durations."""

    __slots__ = ("arrived", "decoded", "queue", "compute", "computed")

    def __init__(self, arrived: float):
        self.arrived = arrived
        self.decoded: Optional[float] = None
        self.queue = self.compute = 0.0  # summed over its batches (a step that waited apart has a second one)
        self.computed: Optional[float] = None  # when its last batch's last step was computed

    def mark_decoded(self) -> None:
        self.decoded = perf_counter()

    def add_batch(self, submitted: float, started: float, finished: float) -> None:
        """A batch of the message's steps, settled: submitted, its first round started, its last step computed."""
        self.queue += started - submitted
        self.compute += finished - started
        self.computed = finished if self.computed is None else max(self.computed, finished)

    def wire(self) -> dict[str, float]:
        """The durations so far, the reply built now."""
        built = perf_counter()
        decoded = self.decoded if self.decoded is not None else built
        computed = self.computed if self.computed is not None else decoded
        return {"decode": round(decoded - self.arrived, 6), "queue": round(self.queue, 6),
                "compute": round(self.compute, 6), "reply": round(built - computed, 6),
                "total": round(built - self.arrived, 6)}


_CURRENT: ContextVar[Optional[MessageTimings]] = ContextVar("message_timings", default=None)


def timed_message(arrived: float) -> MessageTimings:
    """Timings for the message the calling task answers (its own context: a task per message)."""
    timings = MessageTimings(arrived)
    _CURRENT.set(timings)
    return timings


def current_timings() -> Optional[MessageTimings]:
    """The timings of the message the calling task answers, if any (a push's steps have none)."""
    return _CURRENT.get()
