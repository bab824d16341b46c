"""Concurrent calls of a row-wise function, merged into one call on all their rows.

The client's LM head is the case in point: with 16 sessions decoding at once, 16 threads each need
(1, hidden) @ (hidden, vocab). Each call reads the whole head matrix (a fifth of a small model's weights);
one call on 16 rows reads it once (and, with the head on a GPU, moves rows and logits across once each way).
Callers that arrive while a merged call runs wait for it to finish, then the first of them runs everything
that queued meanwhile: no timer, no added latency for a lone caller.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass(eq=False)
class _Call:
    rows: torch.Tensor
    settled: threading.Event = field(default_factory=threading.Event)
    lead: bool = False  # woken to run the next merged call, not with a result
    result: Optional[torch.Tensor] = None
    error: Optional[BaseException] = None


class Coalescer:
    def __init__(self, function: Callable[[torch.Tensor], torch.Tensor]):
        self.function = function  # (rows, ...) -> (rows, ...), each output row depending on its input row only
        self._lock = threading.Lock()
        self._queue: list[_Call] = []
        self._running = False

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        call = _Call(rows)
        with self._lock:
            self._queue.append(call)
            call.lead = not self._running
            self._running = True
        if not call.lead:
            call.settled.wait()
        if call.lead:  # first in: run what has queued (this call included), then pass the lead on
            self._run_queued()
        if call.error is not None:
            raise call.error
        return call.result

    def _run_queued(self) -> None:
        with self._lock:
            calls, self._queue = self._queue, []
        try:
            merged = self.function(torch.cat([call.rows for call in calls]) if len(calls) > 1 else calls[0].rows)
            for call, result in zip(calls, merged.split([len(call.rows) for call in calls])):
                call.result = result
        except BaseException as error:
            for call in calls:
                call.error = error
        with self._lock:
            if self._queue:  # callers that came meanwhile: the first of them runs the next merged call
                self._queue[0].lead = True
                self._queue[0].settled.set()
            else:
                self._running = False
        for call in calls:
            call.lead = False
            call.settled.set()
