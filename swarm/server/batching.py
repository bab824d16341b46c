"""Continuous batching on a block server: every step waiting for the compute thread runs in one forward.

Requests arrive on the event loop (one step per session at a time, plus cache-less forwards) and are submitted
here as jobs (Scheduler.submit), which queue. The compute thread takes, in each round, every waiting decode
step of one block range and as much of the waiting prefills as the round's token budget leaves, packs their
tokens side by side (swarm/server/attention.py) and computes them through the span at once: the weights are
read once for all of them. A long prompt goes through in chunks of at most `prefill_chunk_tokens`, round after
round, so the sessions that are decoding meanwhile wait for one chunk at most, never for the whole prompt. The
chunks of one prompt go in order and write the session's cache like one step would, so the outputs are the
same. A cache-less forward is no exception: one that fits a chunk goes in one piece beside the others; a
longer one gets a temporary cache from the backend (swarm/server/backend.py) and goes through in chunks like
a prompt.

The steps of one message (swarm/server/handler.py: many sessions' steps) are submitted together as one Batch:
one lock, one wake-up of the compute thread, one future resolved once the last of them is computed (one
wake-up of the event loop), whatever the number of sessions. A short step (a decode step, or a speculative
verify step of up to VERIFY_POSITIONS positions) is never cut: it goes whole into the next round, beside the
other sessions' steps, and only prompts' chunks share what the round's token budget leaves.

A round that fails on the server's own fault (a bug, out of memory) fails each of its jobs with an
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
from swarm.server.timings import MessageTimings, current_timings
from swarm.protocol import BadRequestError, InternalServerError, ServerUnavailableError, SwarmError

logger = logging.getLogger(__name__)


# a step of at most this many positions goes whole into a round (a decode step, or 1 + a draft being verified:
# config.MAX_SPECULATIVE_TOKENS); longer ones are prompts, computed a chunk per round
VERIFY_POSITIONS = 33


@dataclass(eq=False)
class Job:
    """What the compute thread is asked for: new positions (rows, length, hidden) through blocks [start, end),
    from `position` (a session's step, a cache-less forward, or some rows of one), until all are computed. A
    job of a Batch has no loop or future of its own: the batch resolves its jobs together."""

    hidden: torch.Tensor
    position: int
    start: int
    end: int
    cache: Optional[SessionCache]  # None: cache-less sequences, nothing kept (they fit one chunk: one piece)
    loop: Optional[asyncio.AbstractEventLoop] = None
    future: Optional[asyncio.Future] = None
    still_wanted: Callable[[], bool] = lambda: True  # false once the session is gone or evicted
    # called on the event loop once the compute thread is done with the job (finished, failed or dropped),
    # before its result is set: what frees a temporary cache, which no round may write after it is freed
    on_settled: Optional[Callable[[], None]] = None
    adapter: Optional[str] = None  # the LoRA adapter its positions go through (swarm/server/adapters.py)
    computed: int = 0  # positions already computed
    outputs: list = field(default_factory=list)
    batch: Optional["Batch"] = None
    index: int = 0  # its place in its batch

    @property
    def rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def remaining(self) -> int:
        return self.hidden.shape[1] - self.computed

    @property
    def wanted(self) -> bool:
        future = self.batch.future if self.batch is not None else self.future
        return not future.cancelled() and self.still_wanted()  # cancelled: its caller hung up

    @property
    def short(self) -> bool:
        """A cached session's decode or verify step: it goes whole into one round."""
        return self.cache is not None and self.computed == 0 and self.remaining <= VERIFY_POSITIONS

    def resolve(self, result=None, error: Optional[BaseException] = None) -> None:
        if self.batch is not None:
            return self.batch.done(self, error if error is not None else result)

        def settle():
            if self.on_settled is not None:
                self.on_settled()
            if not self.future.done():
                self.future.set_exception(error) if error is not None else self.future.set_result(result)

        _call_on(self.loop, settle)


class Batch:
    """Jobs submitted together (the steps of one message): resolved together, once the compute thread is done
    with the last of them, each with its outputs or its error, in order."""

    def __init__(self, jobs: list[Job], loop: asyncio.AbstractEventLoop, on_settled: Callable[[list], None],
                 timings: Optional[MessageTimings] = None):
        self.jobs, self.loop, self.future = jobs, loop, loop.create_future()
        self.on_settled = on_settled  # called on the event loop with the results, before the future is set
        self.results: list = [None] * len(jobs)
        self.pending = len(jobs)
        for index, job in enumerate(jobs):
            job.batch, job.index = self, index
        # the message's timings (swarm/server/timings.py): submitted, first round started, last job computed
        self.timings, self.submitted = timings, time.perf_counter()
        self.started: Optional[float] = None  # set by the compute thread's first round of one of its jobs
        self.finished = 0.0

    def done(self, job: Job, result) -> None:
        """On the compute thread: one job's outputs (or error); the last one settles the batch."""
        self.results[job.index] = result
        self.pending -= 1
        if self.pending == 0:
            self.finished = time.perf_counter()
            _call_on(self.loop, self._settle)

    def _settle(self) -> None:
        if self.timings is not None:
            self.timings.add_batch(self.submitted, self.started or self.finished, self.finished)
        self.on_settled(self.results)
        if not self.future.done():
            self.future.set_result(self.results)


def _call_on(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:  # the loop is closed (its caller is long gone): nothing is left to settle
        pass


class Scheduler:
    """The server's one compute thread and the queue in front of it: `await submit(...)` queues a job and
    returns its outputs once computed."""

    def __init__(self, span_of: Callable[[], BlockSpan], max_batch_tokens: int = 1024, prefill_chunk_tokens: int = 128,
                 pipeline: Optional[bool] = None):
        self._span_of = span_of  # the span may change while the server runs (it moves to other blocks)
        # a round is queued before the one in flight is delivered (None: on a GPU, where a round is queued, not
        # computed, by the thread; True on a CPU only makes the tests go through that path)
        self.pipeline = pipeline
        self.max_batch_tokens, self.prefill_chunk_tokens = max_batch_tokens, prefill_chunk_tokens
        self._waiting: list[Job] = []
        self._wakeup = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._compute_until_stopped, name="compute", daemon=True)
        self._thread.start()

    async def submit(self, hidden: torch.Tensor, position: int, start: int, end: int,
                     cache: Optional[SessionCache] = None, still_wanted: Callable[[], bool] = lambda: True,
                     on_settled: Optional[Callable[[], None]] = None, adapter: Optional[str] = None) -> torch.Tensor:
        """Outputs of these new positions, once the compute thread has computed them (with others). Without a
        cache, the job must fit one chunk: it cannot be split, and must not hold up decoding sessions."""
        if cache is None and hidden.shape[0] * hidden.shape[1] > self.prefill_chunk_tokens:
            raise ValueError(f"a cache-less job of {hidden.shape[0]} x {hidden.shape[1]} tokens is over one chunk "
                             f"({self.prefill_chunk_tokens}): give it a temporary cache")
        loop = asyncio.get_running_loop()
        job = Job(hidden, position, start, end, cache, loop, loop.create_future(), still_wanted, on_settled, adapter)
        self._enqueue([job])
        began = time.perf_counter()
        try:
            return await job.future
        finally:
            metrics.STEP_SECONDS.observe(time.perf_counter() - began)

    async def submit_batch(self, jobs: list[Job], on_settled: Callable[[list], None]) -> list:
        """Each job's outputs, or its error, once the compute thread is done with all of them (jobs without a
        loop or future: the batch has them). `on_settled(results)` runs on the event loop first, also when the
        caller stops waiting: the compute thread may still hold the jobs then."""
        future = self.enqueue_batch(jobs, on_settled)
        began = time.perf_counter()
        try:
            return await future
        finally:
            metrics.STEP_SECONDS.observe(time.perf_counter() - began)

    def enqueue_batch(self, jobs: list[Job], on_settled: Callable[[list], None]) -> asyncio.Future:
        """submit_batch without waiting: the future of the jobs' results."""
        batch = Batch(jobs, asyncio.get_running_loop(), on_settled, current_timings())
        self._enqueue(jobs)
        return batch.future

    def _enqueue(self, jobs: list[Job]) -> None:
        with self._wakeup:
            self._waiting.extend(jobs)
            self._wakeup.notify()

    def stop(self) -> None:
        with self._wakeup:
            self._stopped = True
            self._wakeup.notify()

    # ------------------------------------------------------------------------------------- compute thread

    def _compute_until_stopped(self) -> None:
        """Rounds one after another. On a GPU, the next round is prepared and queued behind the one in flight
        before that one's outputs are waited for: the device never waits for the host between rounds."""
        in_flight: Optional[Launched] = None  # queued on the device, its outputs not delivered yet
        while True:
            with self._wakeup:
                while in_flight is None and not self._waiting and not self._stopped:
                    self._wakeup.wait()
                if self._stopped and in_flight is None:
                    return
                round_ = self._next_round(busy=in_flight.jobs if in_flight else ()) if not self._stopped else []
            launched = self._launch(round_) if round_ else None
            if in_flight is not None:
                self._deliver(in_flight)
            in_flight = launched
            if in_flight is not None and not self._pipelined(in_flight):
                self._deliver(in_flight)
                in_flight = None

    def _pipelined(self, launched: "Launched") -> bool:
        return self.pipeline if self.pipeline is not None else launched.ready is not None

    def _next_round(self, busy=()) -> list[tuple[Job, int]]:
        """(job, positions to compute now) for one forward: the oldest job's block range; short steps first (decode
        and verify steps, whole), then prefill chunks and cache-less forwards within the token budget. Jobs no
        longer wanted are dropped here; `busy` ones (in the round in flight) wait for it."""
        for job in [job for job in self._waiting if not job.wanted and job not in busy]:
            self._waiting.remove(job)
            job.resolve(error=ServerUnavailableError("the session ended or moved before its step ran"))
        ready = [job for job in self._waiting if job not in busy]
        if not ready:
            return []
        first = ready[0]
        same_range = [job for job in ready if (job.start, job.end) == (first.start, first.end)]
        round_, tokens = [], 0
        for job in (job for job in same_range if job.short):  # whole, never cut
            if tokens + job.rows * job.remaining > self.max_batch_tokens and round_:
                break
            round_.append((job, job.remaining))
            tokens += job.rows * job.remaining
        prefill_room = self.prefill_chunk_tokens
        for job in (job for job in same_range if not job.short):
            positions = min(job.remaining, prefill_room // job.rows, (self.max_batch_tokens - tokens) // job.rows)
            if positions < 1 or (job.cache is None and positions < job.remaining):  # cache-less: in one piece
                if round_:
                    break
                positions = 1 if job.cache is not None else job.remaining  # wider than the budget: moves anyway
            round_.append((job, positions))
            tokens += positions * job.rows
            prefill_room -= positions * job.rows
        return round_

    def _compute_round(self, round_: list[tuple[Job, int]]) -> None:
        launched = self._launch(round_)
        if launched is not None:
            self._deliver(launched)

    def _launch(self, round_: list[tuple[Job, int]]) -> Optional["Launched"]:
        """The round's forward queued on the span's device (computed, on a CPU); None if it failed at once."""
        span = self._span_of()
        round_ = self._without_stale(round_, span)
        if not round_:
            return None
        first, began = round_[0][0], time.perf_counter()
        try:
            segments, pieces = [], []
            for job, positions in round_:
                if job.batch is not None and job.batch.started is None:
                    job.batch.started = began
                segments.append(Segment(job.rows, positions, job.position + job.computed, job.cache, job.adapter))
                pieces.append(_piece(job, positions))
            packed = span.on_device(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1))
            # checked on the device, without waiting for it: a token that is not finite is zeroed (nothing not
            # finite reaches a cache page, where a masked NaN still poisons attention), and its job fails on delivery
            finite = torch.isfinite(packed[0]).all(dim=-1)  # (tokens,)
            packed = torch.nan_to_num(packed, 0.0, 0.0, 0.0)
            output = span.forward_packed(packed, segments, first.start, first.end)[0]
            return Launched(round_, segments, *_copied_to_host(output, finite))
        except Exception as error:  # a bug or out of memory: every job of the round fails, the thread goes on
            self._fail(round_, error)
            return None

    def _deliver(self, launched: "Launched") -> None:
        """The round's outputs, once on the host, to its jobs; a job whose last positions they are is done."""
        round_, segments, output = launched.round_, launched.segments, launched.output
        try:
            if launched.ready is not None:
                launched.ready.synchronize()  # yields the thread, where a plain .to("cpu") spins a core
        except Exception as error:  # a device error surfaces here: the round's jobs fail, the thread goes on
            self._fail(round_, error)
            return
        metrics.BATCH_SIZE.observe(sum(job.rows for job, _ in round_))
        all_finite = bool(launched.finite.all())  # else each job's tokens are checked
        offset, finished, refused = 0, [], []
        for (job, positions), segment, part in zip(round_, segments, _parts(output, round_, segments)):
            if not all_finite and not launched.finite[offset : offset + segment.tokens].all():
                refused.append(job)
            else:
                job.outputs.append(part)
                job.computed += positions
                if job.remaining == 0:
                    finished.append(job)
            offset += segment.tokens
        with self._wakeup:
            for job in finished + refused:
                self._waiting.remove(job)
        for job in refused:
            job.resolve(error=BadRequestError("hidden states must be finite (no NaN or infinity)"))
        for job in finished:
            outputs = job.outputs[0] if len(job.outputs) == 1 else torch.cat(job.outputs, dim=1)
            job.resolve(outputs if outputs.dtype == job.hidden.dtype else outputs.to(job.hidden.dtype))

    def _without_stale(self, round_: list[tuple[Job, int]], span: BlockSpan) -> list[tuple[Job, int]]:
        """The round less the jobs whose cache lies in a pool this span does not use: the server moved to
        other blocks since they were submitted, and their page numbers mean nothing in the new pool. They fail
        with an error the client retries elsewhere; the rest of the round goes on."""
        stale = [(job, positions) for job, positions in round_
                 if job.cache is not None and job.cache.pool is not span.pool]
        if stale:
            self._fail(stale, ServerUnavailableError("this server moved to other blocks while the request ran; "
                                                     "try again"))
        return [entry for entry in round_ if entry not in stale]

    def _fail(self, round_: list[tuple[Job, int]], error: Exception) -> None:
        """Fail every job of a round. A SwarmError is the request's own (it travels as it is); anything else
        is the server's own failure: counted and logged here, once for the round, and each job gets an
        InternalServerError, which the handler sends on without logging it again."""
        if not isinstance(error, SwarmError):
            metrics.INTERNAL_ERRORS.labels("compute").inc()
            logger.error("a compute round of %d request(s) failed", len(round_), exc_info=error)
        with self._wakeup:
            for job, _ in round_:
                self._waiting.remove(job)
        for job, _ in round_:
            failure = error if isinstance(error, SwarmError) else \
                InternalServerError("internal server error (see the server's log)")
            job.resolve(error=failure)


def _piece(job: Job, positions: int) -> torch.Tensor:
    """The job's next `positions` positions as (1, tokens, hidden): a whole one-row step as it is (no tensor
    call per step: a round of 64 sessions' steps would issue 128 more)."""
    if job.rows == 1 and job.computed == 0 and positions == job.hidden.shape[1]:
        return job.hidden
    return job.hidden[:, job.computed : job.computed + positions].reshape(1, -1, job.hidden.shape[-1])


def _parts(output: torch.Tensor, round_: list[tuple[Job, int]], segments: list[Segment]) -> list[torch.Tensor]:
    """A round's packed outputs (tokens, hidden) as each job's (rows, positions, hidden): views, in one split
    where every job has one row."""
    sizes = [segment.tokens for segment in segments]
    if all(job.rows == 1 for job, _ in round_):
        return list(output[None].split(sizes, dim=1))
    return [part.view(job.rows, positions, -1) for part, (job, positions) in zip(output.split(sizes), round_)]


@dataclass
class Launched:
    """A round whose forward is queued on the device: its outputs land in `output` (host memory) once `ready`
    (None: computed already, on a CPU)."""

    round_: list[tuple[Job, int]]
    segments: list[Segment]
    output: torch.Tensor
    finite: torch.Tensor  # (tokens,) bool, in host memory: which of the round's input tokens were finite
    ready: Optional["torch.cuda.Event"]

    @property
    def jobs(self) -> set[Job]:
        return {job for job, _ in self.round_}


def _copied_to_host(output: torch.Tensor, finite: torch.Tensor) -> tuple:
    """A round's outputs and its tokens' finite flags on their way to the host: from a GPU, copied into pinned
    memory behind the round's kernels, with the event that says they are there."""
    if output.device.type != "cuda":
        return output, finite, None
    copies = []
    for tensor in (output, finite):
        copies.append(torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True))
        copies[-1].copy_(tensor, non_blocking=True)
    ready = torch.cuda.Event(blocking=True)
    ready.record()
    return *copies, ready
