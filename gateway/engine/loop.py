"""One served model's engine loop: every session's tokens computed together, a tick at a time, on one thread.

    request threads --submit(Sequence)--> EngineLoop --tick--> each Sequence's OutputStream --> ReplyReader
                                             |   ^
                       start_steps (no wait) v   | steps' outputs, as each chain answers (on the swarm's event loop)
                                          the swarm

Each tick (vLLM's EngineCore is the model; the block servers have the same shape):
  1. takes new sequences and aborts;
  2. takes the sequences whose steps came back: their rows go through the LM head in one call, and every plain row
     is sampled in one batched call on the head's device (sampler.py); only the chosen ids cross to the host;
  3. embeds the next tokens of every sequence with a step to send (all, or their turns once saturated: below), in
     one call;
  4. starts all those steps at once without waiting (swarm.client: the steps bound for one server leave in one
     message), and goes back to waiting.
A session on a slow chain is simply not among the arrivals of a tick: it never holds the others, and a failover
happens inside its own step. The thread runs torch calls only: detokenizing, stop sequences and framing happen in
each request's thread (outputs.py).

When many sessions decode together, the servers are the bottleneck, and a chain moving them all in step would keep
each server idle while the others compute (n - 1 of n servers, at any moment). So past `Pipeline.min_sessions`, the
loop keeps sessions in groups (a group per server of a chain, by default: vLLM's virtual engines fill a pipeline so)
and each server's step channel carries one group per message (swarm/client/step_channel.py): the first server
computes one group while the second computes the one before. Fewer sessions travel as one group: a session alone is
never held up by a group.

Past ENGINE_MAX_STEPS steps in flight (no bound by default) the loop is saturated: the sessions ready past it wait
for steps to come back, and take turns shared between clients, not sessions (or between sessions: ENGINE_SHARING),
see turns.py: one client's many sessions then cannot take the servers' rounds from another's.

A model the catalogue lets go (MAX_LOADED_MODELS) keeps its loop while sessions on it run; the thread then ends, and
starts again if a late one submits (`on_end` tells the engine, which forgets the loop and with it the model).

Speculation is the loop's policy: sequences draft only while few decode together (vLLM and Arctic turn drafting
off under load too: verifying k guesses costs k positions of every server's round for each session).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass

import torch

from gateway.engine.metrics import ABORTED_REPLIES, ENGINE_ROWS, ENGINE_STEPS, ENGINE_TICKS
from gateway.engine.sampler import sample_rows
from gateway.engine.sequences import Sequence
from gateway.engine.turns import Sharing, Turns
from gateway.errors import NotFound
from swarm.client import stage_clock

logger = logging.getLogger(__name__)
LET_GO_CHECK_SECONDS = 1.0  # how often an idle loop looks whether its model was let go (nothing wakes it for that)


@dataclass
class TickCounts:
    """What the loop has done, for tests and the benchmark: calls per tick are what predict its speed."""

    ticks: int = 0  # ticks that computed something
    embeds: int = 0  # embedding calls
    heads: int = 0  # LM-head calls
    samplings: int = 0  # batched sampling calls (a verified draft's tokens are sampled one by one on top)
    rows: int = 0  # logits rows sampled
    steps: int = 0  # chain steps started


@dataclass(frozen=True)
class Pipeline:
    """How many groups of sessions travel apart (see the module's docstring): `groups` (0: one per server of a
    session's chain), once at least `min_sessions` decode together; else one."""

    groups: int = 0
    min_sessions: int = 8

    def group_of(self, serial: int, hops: int, decoding: int) -> int:
        if decoding < self.min_sessions:
            return 0
        return serial % max(self.groups or hops, 1)


class EngineLoop:
    @classmethod
    def under(cls, limits, model, on_end=lambda loop: None) -> "EngineLoop":
        """The loop of `model` with the policies of config.Limits: drafting, the pipeline, the turns."""
        pipeline = Pipeline(limits.pipeline_groups, limits.pipeline_min_sessions)
        return cls(model, limits.speculative_max_sessions, pipeline, Sharing(limits.engine_max_steps,
                                                                             limits.engine_sharing), on_end)

    def __init__(self, model, max_drafting_sessions: int, pipeline: Pipeline = Pipeline(),
                 sharing: Sharing = Sharing(), on_end=lambda loop: None):
        """`model`: a ServedModel; sequences draft only while at most `max_drafting_sessions` are decoding;
        `sharing`: how many steps may be in flight, and who takes turns past it (turns.py); `on_end(loop)`: its
        thread ended, its model let go."""
        self.model, self.remote = model, model.remote
        self.max_drafting_sessions, self.pipeline = max_drafting_sessions, pipeline
        self.turns = Turns(sharing)  # ready sequences waiting for room among the steps in flight
        self._serials = itertools.count()  # each sequence's: its group in the pipeline
        self.counts = TickCounts()
        self._inbox: deque = deque()  # ("start", sequence) or ("abort", sequence, kept)
        self._arrivals: deque = deque()  # (sequence, outputs, error)
        self._wake = threading.Event()
        self._running: set[Sequence] = set()
        self._on_end, self._thread_lock, self._thread = on_end, threading.Lock(), None
        self._wake_up()

    def _wake_up(self) -> None:
        """Its thread runs a tick soon: started (again) where it had ended."""
        with self._thread_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"engine-loop-{self.model.name}", daemon=True)
                self._thread.start()
        self._wake.set()

    # ---- the face the engine's request threads use

    def submit(self, *sequences: Sequence) -> None:
        """Start these replies (in the same tick: n choices, or a test's sessions)."""
        self._inbox.extend(("start", sequence) for sequence in sequences)
        self._wake_up()

    def abort(self, sequence: Sequence, kept: int, wait: bool = True) -> None:
        """End the reply after its first `kept` tokens (its reader stopped there: a stop sequence, a client gone, a
        stop message), and wait until the session holds exactly that (`wait`: a reader closed by the garbage
        collector, on whatever thread, never waits). Only the first abort of a reply counts; any abort waits."""
        if not sequence.aborted:
            sequence.aborted = True
            ABORTED_REPLIES.labels(self.model.name).inc()
            self._inbox.append(("abort", sequence, kept))
            self._wake_up()
        if wait and threading.current_thread() is not self._thread:
            sequence.settled.wait()

    # ---- the loop

    def _run(self) -> None:
        while not self._ended():
            self._wake.wait(LET_GO_CHECK_SECONDS)
            self._wake.clear()
            try:
                self._tick()
            except Exception:  # a bug: logged, and the loop goes on serving (the sequences at fault were failed)
                logger.exception("the engine loop of %s failed a tick", self.model.name)
        self._on_end(self)

    def _ended(self) -> bool:
        """Whether the thread ends here: its model let go, and nothing to do (a submit after this starts another)."""
        if not getattr(self.model, "let_go", False):
            return False
        with self._thread_lock:
            if self._inbox or self._arrivals or self._running:
                return False
            self._thread = None
            return True

    def _tick(self) -> None:
        ready, arrived = [], []
        try:
            ready = self._take_inbox()
            arrived = self._take_arrivals()
            if arrived or ready:
                self.counts.ticks += 1
                ENGINE_TICKS.labels(self.model.name).inc()
            began = stage_clock.now()
            if arrived:
                ready += self._sample(arrived)
                stage_clock.CLOCK.add("engine_sample", stage_clock.now() - began, len(arrived))
            self.turns.add(ready)
            ready = self.turns.take()  # all of them, unless the loop is saturated
            if ready:
                sending = stage_clock.now()
                self._send(ready)
                stage_clock.CLOCK.add("engine_send", stage_clock.now() - sending, len(ready))
            for sequence, _ in arrived:  # the tokens go to their readers once the next steps are on their way
                sequence.publish()
        except Exception as error:  # a bug: this tick's sequences fail (never hang), the others go on
            for sequence in [*ready, *(sequence for sequence, _ in arrived)]:
                if not sequence.done and not sequence.in_flight:
                    self._fail(sequence, error)
            raise

    def _take_inbox(self) -> list[Sequence]:
        ready = []
        while self._inbox:
            kind, sequence, *kept = self._inbox.popleft()
            if kind == "start":
                sequence.serial = next(self._serials)
                self._running.add(sequence)
                ready.append(sequence)
            elif sequence.done:  # ended already (by its own finish, or a failure): only the kept tokens change
                if sequence.stream.error is None:
                    sequence.settle(min(kept[0], len(sequence.generated)))
            elif sequence.in_flight:
                sequence.abort_at = kept[0]  # settled when its step comes back
            else:
                self._end(sequence, kept[0])
                if sequence in ready:
                    ready.remove(sequence)
        return ready

    def _take_arrivals(self) -> list[tuple[Sequence, torch.Tensor]]:
        arrived, taken = [], stage_clock.now()
        while self._arrivals:
            sequence, outputs, error, came = self._arrivals.popleft()
            stage_clock.CLOCK.add("engine_wake", taken - came)
            sequence.in_flight = False
            self.turns.landed(sequence)
            if error is not None:
                sequence.session.broken = True  # the servers may hold some of the step or none of it
                self._fail(sequence, error)
                continue
            sequence.landed()
            if sequence.abort_at is not None:
                self._end(sequence, sequence.abort_at)
            elif sequence.head_rows() == 0:  # a feed alone (a saved prefix, a reply of no tokens)
                self._end(sequence, 0)
            else:
                arrived.append((sequence, outputs))
        return arrived

    def _sample(self, arrived: list[tuple[Sequence, torch.Tensor]]) -> list[Sequence]:
        """The LM head over every arrived row in one call, every plain row sampled in one call; the sequences
        that go on."""
        hidden = torch.cat([outputs[0, -sequence.head_rows():] for sequence, outputs in arrived])  # (rows, hidden)
        logits = self.remote.logits_on_device(hidden)  # (rows, vocab), on the head's device
        self.counts.heads += 1
        per_sequence = logits.split([sequence.head_rows() for sequence, _ in arrived])
        plain = [(sequence, rows, allowed) for (sequence, _), rows in zip(arrived, per_sequence)
                 if not sequence.draft and (allowed := self._allowed(sequence)) is not False]
        if plain:
            rows = torch.cat([rows for _, rows, _ in plain])
            tokens = sample_rows(rows, [sequence.sampler for sequence, _, _ in plain],
                                 [allowed for _, _, allowed in plain]).tolist()  # the tick's one host transfer
            self.counts.samplings += 1
            self._count_rows(len(plain))
            for (sequence, _, _), token, row in zip(plain, tokens, rows):
                self._guarded(sequence, sequence.take_plain, token, row)
        for (sequence, _), rows in zip(arrived, per_sequence):
            if sequence.draft:
                self._count_rows(len(rows))
                self._guarded(sequence, sequence.take_verified, rows)
        return [sequence for sequence, _ in arrived if not sequence.done]

    def _send(self, ready: list[Sequence]) -> None:
        """Embed every ready sequence's next tokens in one call and start all their steps."""
        ready = [sequence for sequence in ready if self._open(sequence)]
        if not ready:
            return
        may_draft = len(self._running) <= self.max_drafting_sessions
        sends = [sequence.tokens_to_send(may_draft) for sequence in ready]
        ids = torch.tensor([token for tokens in sends for token in tokens])
        positions = torch.tensor([sequence.position + index for sequence, tokens in zip(ready, sends)
                                  for index in range(len(tokens))])
        try:
            hidden = self.remote.embed_rows(ids, positions)  # (tokens, hidden)
            self.counts.embeds += 1
        except Exception as error:  # one sequence's input the embeddings refuse (past learned positions, say)
            return self._send_each(ready, error)
        steps, decoding = [], len(self._running)
        for sequence, rows in zip(ready, hidden.split([len(tokens) for tokens in sends])):
            sequence.sent()
            inference = sequence.session.inference
            inference.group = self.pipeline.group_of(sequence.serial, inference.servers, decoding)
            steps.append((sequence, sequence.session.inference, rows[None], sequence.position))
        self.counts.steps += len(steps)
        ENGINE_STEPS.labels(self.model.name).inc(len(steps))
        self.remote.start_steps(steps, self._arrived)
        self.turns.flew(ready)  # (they land in a later tick, on this thread)

    def _count_rows(self, rows: int) -> None:
        self.counts.rows += rows
        ENGINE_ROWS.labels(self.model.name).inc(rows)

    def _send_each(self, ready: list[Sequence], error: Exception) -> None:
        if len(ready) == 1:
            return self._fail(ready[0], error)
        for sequence in ready:
            sequence.draft = []
            self._send([sequence])

    def _arrived(self, sequence: Sequence, outputs, error) -> None:
        """A step came back (on the swarm's event loop): the next tick takes it."""
        self._arrivals.append((sequence, outputs, error, stage_clock.now()))
        self._wake.set()

    # ---- ending sequences

    def _open(self, sequence: Sequence) -> bool:
        if sequence.session.closed or sequence.session.inference is None:
            self._fail(sequence, NotFound(f"inference session {sequence.session.id} was closed", field="session_id"))
            return False
        return True

    def _allowed(self, sequence: Sequence):
        """The grammar's mask for the sequence's next token (None: no grammar); False if its grammar failed."""
        try:
            return sequence.allowed()
        except Exception as error:
            self._fail(sequence, error)
            return False

    def _guarded(self, sequence: Sequence, take, *args) -> None:
        try:
            take(*args)
        except Exception as error:  # this sequence's own failure (a grammar's, a refused mask): the others go on
            self._fail(sequence, error)
        if sequence.done:
            self._running.discard(sequence)

    def _end(self, sequence: Sequence, kept: int) -> None:
        sequence.settle(kept)
        sequence.stream.end()  # a reader still waiting (its session closed under it) stops waiting
        self._running.discard(sequence)
        self.turns.discard(sequence)

    def _fail(self, sequence: Sequence, error: BaseException) -> None:
        sequence.done = True
        sequence.publish()
        sequence.settled.set()
        sequence.stream.fail(error)
        self._running.discard(sequence)
        self.turns.discard(sequence)
