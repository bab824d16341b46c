"""Continuous batching on a block server: every step waiting for the compute thread runs in one forward.

Requests arrive on the event loop (one step per session at a time, plus cache-less forwards) and queue here.
The compute thread takes, in each round, every waiting decode step of one block range and as much of the
waiting prefills as the round's token budget leaves, packs their tokens side by side (swarm/server/attention.py)
and runs them through the span at once: the weights are read once for all of them. A long prompt goes
through in chunks of at most `prefill_chunk_tokens`, round after round, so the sessions that are decoding
meanwhile wait for one chunk at most, never for the whole prompt. The chunks of one prompt run in order
and write the session's cache like one step would, so the outputs are the same. A cache-less forward is no
exception: one that fits a chunk runs whole beside the others; a longer one gets a temporary cache from the
backend (swarm/server/backend.py) and goes through in chunks like a prompt.

A round that fails on the server's own fault (a bug, out of memory) fails each of its works with an
InternalServerError; it is counted and logged once, with its traceback, however many sessions it had.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from swarm.server import metrics
from swarm.server.attention import Segment
from swarm.server.cache import SessionCache
from swarm.server.span import BlockSpan
from swarm.protocol import InternalServerError, ServerUnavailableError, SwarmError

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Work:
    """One request: new positions (rows, length, hidden) through blocks [start, end), from `position`."""

    hidden: torch.Tensor
    position: int
    start: int
    end: int
    cache: Optional[SessionCache]  # None: whole sequences, no cache kept (they fit one chunk: run whole)
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    still_wanted: Callable[[], bool] = lambda: True  # false once the session is gone or evicted
    # called on the event loop once the compute thread is done with the work (finished, failed or dropped),
    # before its result is set: what frees a temporary cache, which no round may write after it is freed
    on_settled: Optional[Callable[[], None]] = None
    done: int = 0  # positions already computed
    outputs: list = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def remaining(self) -> int:
        return self.hidden.shape[1] - self.done

    @property
    def wanted(self) -> bool:
        return not self.future.cancelled() and self.still_wanted()  # cancelled: its caller hung up

    def resolve(self, result=None, error: Optional[BaseException] = None) -> None:
        def settle():
            if self.on_settled is not None:
                self.on_settled()
            if not self.future.done():
                self.future.set_exception(error) if error is not None else self.future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed (its caller is long gone): nothing is left to settle
            pass


class Scheduler:
    """The server's one compute thread and the queue in front of it."""

    def __init__(self, span_of: Callable[[], BlockSpan], max_batch_tokens: int = 1024, prefill_chunk_tokens: int = 128):
        self._span_of = span_of  # the span may change while the server runs (it moves to other blocks)
        self.max_batch_tokens, self.prefill_chunk_tokens = max_batch_tokens, prefill_chunk_tokens
        self._waiting: list[Work] = []
        self._wakeup = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, name="compute", daemon=True)
        self._thread.start()

    async def run(self, hidden: torch.Tensor, position: int, start: int, end: int,
                  cache: Optional[SessionCache] = None, still_wanted: Callable[[], bool] = lambda: True,
                  on_settled: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """Outputs of these new positions, once the compute thread has run them (with others). Without a
        cache, the work must fit one chunk: it cannot be split, and must not hold up decoding sessions."""
        if cache is None and hidden.shape[0] * hidden.shape[1] > self.prefill_chunk_tokens:
            raise ValueError(f"a cache-less work of {hidden.shape[0]} x {hidden.shape[1]} tokens is over one chunk "
                             f"({self.prefill_chunk_tokens}): give it a temporary cache")
        loop = asyncio.get_running_loop()
        work = Work(hidden, position, start, end, cache, loop, loop.create_future(), still_wanted, on_settled)
        with self._wakeup:
            self._waiting.append(work)
            self._wakeup.notify()
        began = time.perf_counter()
        try:
            return await work.future
        finally:
            metrics.STEP_SECONDS.observe(time.perf_counter() - began)

    def stop(self) -> None:
        with self._wakeup:
            self._stopped = True
            self._wakeup.notify()

    # ------------------------------------------------------------------------------------- compute thread

    def _serve(self) -> None:
        while True:
            with self._wakeup:
                while not self._waiting and not self._stopped:
                    self._wakeup.wait()
                if self._stopped:
                    return
                round_ = self._next_round()
            if round_:
                self._run(round_)

    def _next_round(self) -> list[tuple[Work, int]]:
        """(work, positions to run now) for one forward: the oldest work's block range; decode steps first,
        then prefill chunks and cache-less forwards within the token budget. Works no longer wanted are
        dropped here."""
        for work in [work for work in self._waiting if not work.wanted]:
            self._waiting.remove(work)
            work.resolve(error=ServerUnavailableError("the session ended or moved before its step ran"))
        if not self._waiting:
            return []
        first = self._waiting[0]
        same_range = [work for work in self._waiting if (work.start, work.end) == (first.start, first.end)]
        decoding = [work for work in same_range if work.remaining == 1 and work.cache is not None]
        prefilling = [work for work in same_range if work.remaining > 1 or work.cache is None]
        round_, tokens = [], 0
        for work in decoding:
            if tokens + work.rows > self.max_batch_tokens and round_:
                break
            round_.append((work, 1))
            tokens += work.rows
        prefill_room = self.prefill_chunk_tokens
        for work in prefilling:
            positions = min(work.remaining, prefill_room // work.rows, (self.max_batch_tokens - tokens) // work.rows)
            if positions < 1 or (work.cache is None and positions < work.remaining):  # the latter runs whole
                if round_:
                    break
                positions = 1 if work.cache is not None else work.remaining  # wider than the budget: moves anyway
            round_.append((work, positions))
            tokens += positions * work.rows
            prefill_room -= positions * work.rows
        return round_

    def _run(self, round_: list[tuple[Work, int]]) -> None:
        span, first = self._span_of(), round_[0][0]
        try:
            segments, pieces = [], []
            for work, positions in round_:
                segments.append(Segment(work.rows, positions, work.position + work.done, work.cache))
                pieces.append(work.hidden[:, work.done : work.done + positions].reshape(-1, work.hidden.shape[-1]))
            packed = (pieces[0] if len(pieces) == 1 else torch.cat(pieces))[None]
            output = span.forward_packed(packed, segments, first.start, first.end)[0].to("cpu")
        except Exception as error:  # a bug or out of memory: every work of the round fails, the thread goes on
            self._fail(round_, error)
            return
        metrics.BATCH_SIZE.observe(sum(work.rows for work, _ in round_))
        offset = 0
        finished = []
        for (work, positions), segment in zip(round_, segments):
            work.outputs.append(output[offset : offset + segment.tokens].view(work.rows, positions, -1))
            offset += segment.tokens
            work.done += positions
            if work.remaining == 0:
                finished.append(work)
        with self._wakeup:
            for work in finished:
                self._waiting.remove(work)
        for work in finished:
            outputs = work.outputs[0] if len(work.outputs) == 1 else torch.cat(work.outputs, dim=1)
            work.resolve(outputs.to(work.hidden.dtype))

    def _fail(self, round_: list[tuple[Work, int]], error: Exception) -> None:
        """Fail every work of a round. A SwarmError is the request's own (it travels as it is); anything else
        is the server's own failure: counted and logged here, once for the round, and each work gets an
        InternalServerError, which the handler sends on without logging it again."""
        if not isinstance(error, SwarmError):
            metrics.INTERNAL_ERRORS.labels("compute").inc()
            logger.error("a compute round of %d request(s) failed", len(round_), exc_info=error)
        with self._wakeup:
            for work, _ in round_:
                self._waiting.remove(work)
        for work, _ in round_:
            failure = error if isinstance(error, SwarmError) else \
                InternalServerError("internal server error (see the server's log)")
            work.resolve(error=failure)
