"""A client's inference session on a block server: its attention cache, its steps, and steps pushed to it.

The backend (swarm/server/backend.py) opens sessions and hands each one ServerServices: what a session uses of
its server, and the OpenSessions it joins while open. This module never imports the backend.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

import torch

from swarm.protocol import BadRequestError, ServerUnavailableError, SessionClosedError, SessionLengthError
from swarm.server import metrics
from swarm.server.batching import Job
from swarm.server.cache import PAGE_TOKENS, SessionCache
from swarm.server.fields import declared_positions, int_field, step_id_field
from swarm.server.open_sessions import OpenSessions
from swarm.server.pushes import EarlyStep

logger = logging.getLogger(__name__)


class Parking:
    """Told when a session parks, un-parks or closes: warm.py keeps the parked sessions' counts (this, none)."""

    def on_park(self, session: "ServerSession") -> None:
        pass

    def on_unpark(self, session: "ServerSession") -> None:
        pass

    def on_close(self, session: "ServerSession") -> None:
        pass


@dataclass(frozen=True)
class ServerServices:
    """What a session uses of its server; the backend builds it."""

    open_sessions: OpenSessions  # a session joins it when it opens, and leaves it when it closes
    # a step's one tensor of hidden states (and the session's batch size), refused unless the span can run it
    check_hidden_states: Callable[[list, int], Awaitable[torch.Tensor]]
    # steps of sessions submitted as one batch of jobs (swarm/server/step_batch.py): [(session, hidden, metadata)]
    # -> each one's outputs or error
    run_steps: Callable[[list], Awaitable[list]]
    take_cache: Callable[[str, int], Awaitable[None]]  # (peer id, tokens), within the peer's share, waiting a while
    take_cache_now: Callable[[str, int], bool]  # the same, where it needs no wait and nobody made to leave
    give_back_cache: Callable[[str, int], None]
    idle_timeout: float  # --session-idle-timeout (0: never)
    parking: Parking = Parking()  # told when a session parks, un-parks or closes (see warm.py)


class RoomNeeded(Exception):
    """A step's pages need more of the cache budget than is free now: the step waits for room (reserve)."""


class ServerSession:
    """One client's inference session on this server: its attention cache and how far it is filled.

    A step's inputs come from the client, and may come earlier from the previous server of the client's
    chain, which pushes its outputs here as soon as it has them (server-to-server push): the step then starts
    at once, and the client's own copy of the inputs, arriving later, collects the result. Step ids
    (increasing per session) tell which copy came first. The client's copy is what counts: a push only ever
    continues the session where it is (never rewinds it), and a pushed step whose inputs differ from the
    client's copy (a server that pushes other outputs than it returns to the client) runs again from the
    client's copy. Steps of a session never overlap, whoever sends them.

    Whoever knows the session's id (the chain's previous server) can push, so a push is computed only where it
    is what the client's own next step will ask for: at the session's length, and of no more positions than the
    client declared, at the opening and in each of its steps, its next step may carry (field 'next_positions':
    1 for a decode step, 1 + a draft while drafting, a prompt's size). Until the client's copy of a pushed step
    comes (and declares anew), no other push is computed. Any other push is refused, and the client's copy runs:
    a hostile peer can make a session compute at most one step of the client's own size per step of the client.

    The server closes a session that has had no step for --session-idle-timeout seconds, or, idle, to make
    room for another peer when its peer holds at least as much of the cache (Backend.take_cache): its cache
    goes back, its stream ends, and its client's next step finds no session (and fails over). A session its
    client parked (kept warm for reuse, see park) may also be closed whenever another needs room, or when parked
    sessions hold more than their share of the cache (swarm/server/warm.py); its next step un-parks it.

    A session may start as a fork of another of the same peer (fork_cache): it shares the source's pages of
    its first positions, copy-on-write (swarm/server/cache.py).

    A session closed while the compute thread still holds one of its steps (in a round, or queued) gives its
    pages and budget back only once that step has settled: a round never writes pages that another session
    (or the zero page every padded key reads) may hold by then.
    """

    def __init__(self, server: ServerServices, cache: SessionCache, start: int, end: int, max_length: int,
                 batch_size: int, peer_id: str, session_id: Optional[str] = None, length: int = 0,
                 adapter: Optional[str] = None, next_positions: int = 0):
        self.server, self.start, self.end = server, start, end
        self.adapter = adapter  # the LoRA adapter every step of it goes through (None: the base model)
        self.max_length, self.batch_size, self.peer_id, self.id = max_length, batch_size, peer_id, session_id
        self.cache = cache  # empty, or a fork's shared pages: it takes pages as it grows
        self.length = length  # positions filled in the cache
        self.parked = False  # its client keeps it warm for reuse: the server may close it to make room
        self.push_allowance = next_positions  # the most positions a push may carry now (see the class)
        self._closed = False
        self.closed_because: Optional[str] = None  # "idle", "reclaimed" or "evicted" when the server closed it
        self.evicted = False  # the server moved to other blocks: the client must go elsewhere
        self._newest_step = -1  # the highest step id of the client's own steps (a push's counts once they come)
        self._early: Optional[EarlyStep] = None
        # the pushed step last taken (by a flowing step, most often): see take_early
        self._taken: Optional[EarlyStep] = None
        self.push_arrival: Optional[asyncio.Future] = None  # a flowing step waiting (see pushes.awaited_push)
        self.stepping = False  # a step of it is being computed, or waits for room: one at a time
        self._idle = asyncio.Event()  # set while it is not busy: what a fork of it waits for
        self._idle.set()
        self.last_active = time.monotonic()  # when its last step ended (or it opened)
        self.ended = asyncio.Event()  # set once closed, by its client or by the server
        self._idle_timer: Optional[asyncio.TimerHandle] = None
        self._in_flight = 0  # its steps the compute thread holds (a cancelled step's job may still be in a round)
        self._cache_given_back = False
        server.open_sessions.add(self)
        metrics.SESSIONS.inc()
        self._close_when_idle()

    @property
    def busy(self) -> bool:
        """A step is running, or waiting for room, or the compute thread still holds one."""
        return self.stepping or self._in_flight > 0

    async def step(self, tensors: list, metadata: dict) -> torch.Tensor:
        """One step of this session alone (what a message of one step comes to, see swarm/server/step_batch.py)."""
        hidden = await self.server.check_hidden_states(tensors, self.batch_size)
        [result] = await self.server.run_steps([(self, hidden, metadata)])
        if isinstance(result, BaseException):
            raise result
        return result

    def take_early(self, metadata: dict) -> Optional[EarlyStep]:
        """The client's copy of a step came: the pushed step started before it, or still running for a flowing
        step (whose answer was late), if any. It waits for it, and takes its result if of the same inputs."""
        step_id = step_id_field(metadata, required=False)
        self.push_allowance = declared_positions(metadata, self.max_length)  # for the step after this one
        self._unpark()  # at once: no eviction may close it while the step waits its turn
        self._push_came()  # a flowing step still waiting for its push is answered: this copy supersedes it
        early, self._early = self._early, None
        if early is None and self._taken is not None and self._taken.step_id == step_id \
                and not self._taken.result.done():
            return self._taken
        self._taken = early
        if step_id is not None:
            self._newest_step = max(self._newest_step, step_id)
        return early

    def begin_step(self, hidden: torch.Tensor, metadata: dict) -> Job:
        """The step's job for the compute thread, its pages taken, without waiting: RoomNeeded where the budget
        has no room for them now (begin_step_after_room waits for it)."""
        if self.stepping:
            raise BadRequestError("this session has a step running already: a session steps one at a time")
        position, end = self._checked_range(hidden, metadata)
        needed = self.cache.pages_needed(position, end)
        if needed:
            if not self.server.take_cache_now(self.peer_id, needed * PAGE_TOKENS):
                raise RoomNeeded()
            taken = self.cache.prepare(position, end)
            if needed > taken:
                self.server.give_back_cache(self.peer_id, (needed - taken) * PAGE_TOKENS)
        return self._started(hidden, position)

    async def begin_step_after_room(self, hidden: torch.Tensor, metadata: dict) -> Job:
        """begin_step for a step whose pages wait for room in the budget (a full cache: rare)."""
        if self.stepping:
            raise BadRequestError("this session has a step running already: a session steps one at a time")
        self.stepping = True  # no other step of it starts while this one waits
        self._idle.clear()
        try:
            position, end = self._checked_range(hidden, metadata)
            await self.reserve(position, end)
            self._checked_range(hidden, metadata)  # closed or evicted while it waited
        finally:
            self.stepping = False
            self._idle_if_done()
        return self._started(hidden, position)

    def step_settled(self, job: Job, result) -> None:
        """On the event loop, once the compute thread is done with the step's job: its outputs, or its error."""
        self.stepping = False
        self.last_active = time.monotonic()
        if not isinstance(result, BaseException):
            self.length = job.position + job.hidden.shape[1]
            self.server.open_sessions.positions_served += job.hidden.shape[1]
            metrics.POSITIONS_SERVED.inc(job.hidden.shape[1])
        self._settled()
        self._idle_if_done()

    def _idle_if_done(self) -> None:
        if not self.busy:
            self._idle.set()

    def pushed(self, hidden: torch.Tensor, metadata: dict) -> Optional[EarlyStep]:
        """A step's inputs pushed by the previous server: an early step, its job to start now; None where the
        client's copy will do (it came first, or an earlier push awaits it, or the push would not continue the
        session where it is: an honest one only rewinds it when the client does). Refused (BadRequestError)
        where it carries more positions than the client declared its next step may (see the class)."""
        step_id = step_id_field(metadata)
        if step_id <= self._newest_step or self._early is not None or metadata.get("position") != self.length \
                or self.stepping:
            return None
        if hidden.shape[1] > self.push_allowance:
            raise BadRequestError(self._over_allowance(hidden.shape[1]))
        try:
            job = self.begin_step(hidden, metadata)
        except RoomNeeded:
            return None
        # its id is not the session's newest until the client's copy of it comes (take_early): a hostile push
        # of a far step id must not make every later push look stale
        self._unpark()
        self.server.open_sessions.steps_pushed += 1
        self._early = EarlyStep(step_id, hidden, self.length, asyncio.get_running_loop().create_future(), job)
        self._push_came()
        return self._early

    def early_step(self, step_id: int) -> Optional[EarlyStep]:
        """The pushed step of this id, started and not yet taken by a client's step; else None."""
        return self._early if self._early is not None and self._early.step_id == step_id else None

    def push_may_come(self, step_id: int) -> bool:
        """Whether a push of step `step_id` may still be taken (no step of this id or later has started)."""
        return step_id > self._newest_step and not self._closed

    def _push_came(self) -> None:
        if self.push_arrival is not None and not self.push_arrival.done():
            self.push_arrival.set_result(None)

    def _over_allowance(self, positions: int) -> str:
        if not self.push_allowance:
            return ("a pushed step is computed only where the client declared its next step (field "
                    "'next_positions'), and it declared none; the client's own copy will run")
        return (f"a pushed step of {positions} positions is over the {self.push_allowance} the client declared its "
                f"next step may carry (field 'next_positions'): not computed; the client's own copy will run")

    def early_settled(self, early: EarlyStep, result) -> None:
        """A pushed step's job is done: the session's step ends, and its result awaits the client's copy."""
        self.step_settled(early.job, result)
        if early.result.done():  # cancelled: the session closed
            return
        if isinstance(result, BaseException):
            early.result.set_exception(result)
            early.result.exception()  # retrieved: nobody need ever look at it
        else:
            early.result.set_result(result)

    def _checked_range(self, hidden: torch.Tensor, metadata: dict) -> tuple[int, int]:
        """The positions [position, end) the step writes; a position below the length rewinds the session."""
        if self.evicted:
            raise ServerUnavailableError(f"this server no longer holds blocks {self.start}:{self.end}")
        if self._closed:
            raise SessionClosedError(f"the server closed this session ({self.closed_because})") if self.closed_because \
                else ServerUnavailableError("this session has ended (closed by its client)")
        # a position below the current length rewinds the session (regenerate, or a replay after failover)
        position = int_field(metadata, "position", 0, self.length)
        end = position + hidden.shape[1]
        if end > self.max_length:
            raise SessionLengthError(
                f"session max_length exceeded: {end} tokens would not fit in max_length={self.max_length}"
            )
        if end < self.length and not self._in_flight:  # a rewind (rejected draft tokens): their pages go back now
            self.length = position  # what follows is stale whether or not this step runs
            self.server.give_back_cache(self.peer_id, self.cache.truncate(end) * PAGE_TOKENS)
        return position, end

    def _started(self, hidden: torch.Tensor, position: int) -> Job:
        self.stepping = True
        self._idle.clear()
        self._in_flight += 1  # _settled once the compute thread is done with it, whatever happens meanwhile
        return Job(hidden, position, self.start, self.end, self.cache, still_wanted=self._wanted,
                   adapter=self.adapter)

    async def reserve(self, start: int, end: int) -> None:
        """The pages a write of positions [start, end) of every row takes (new ones, and copies of shared
        ones), paid for in the budget (waiting a bounded time for room) and taken, before the step is submitted.
        While it waits, a sharer may let go of a page (fewer copies needed): what was paid and not taken goes
        back."""
        paid = 0
        try:
            while (needed := self.cache.pages_needed(start, end)) > paid:
                await self.server.take_cache(self.peer_id, (needed - paid) * PAGE_TOKENS)
                paid = needed
                if self._closed:  # closed while waiting: what it paid goes straight back
                    raise ServerUnavailableError("the session ended while waiting for cache")
        except BaseException:
            if paid:
                self.server.give_back_cache(self.peer_id, paid * PAGE_TOKENS)
            raise
        taken = self.cache.prepare(start, end) if paid else 0
        if paid > taken:
            self.server.give_back_cache(self.peer_id, (paid - taken) * PAGE_TOKENS)

    async def fork_cache(self, length: int) -> SessionCache:
        """A cache sharing this session's pages of positions [0, length) (see SessionCache.fork), once no step
        of this session runs: a round writing them now would write pages the fork shares."""
        while self.busy and not (self._closed or self.evicted):
            await self._idle.wait()
        if self._closed or self.evicted or self.busy:
            raise BadRequestError("the session to fork has ended, or a step of it is still running")
        if length > self.length:
            raise BadRequestError(f"field 'fork.length' must be at most the forked session's length "
                                  f"({self.length}), got {length}")
        self.last_active = time.monotonic()  # a saved prefix forked often stays warm
        return self.cache.fork(length)

    def park(self) -> None:
        """Its client keeps it for reuse, idle: the server may close it to make room (see warm.py). A session of
        blocks the server no longer serves is not kept: its client's next step goes elsewhere anyway."""
        if not (self._closed or self.evicted or self.parked):
            self.parked = True
            self.server.parking.on_park(self)

    def _unpark(self) -> None:
        if self.parked:
            self.parked = False
            self.server.parking.on_unpark(self)

    def _wanted(self) -> bool:
        return not (self._closed or self.evicted)

    def _settled(self) -> None:
        self._in_flight -= 1
        if self._closed and not self._in_flight:
            self._give_back_cache()

    def _give_back_cache(self) -> None:
        """The session's pages, once: when it closes, or after that when its last step settles. The budget
        gets back the slots of the pages nobody else holds (a fork's shared pages stay with the other holders)."""
        if not self._cache_given_back:
            self._cache_given_back = True
            self.server.give_back_cache(self.peer_id, self.cache.release() * PAGE_TOKENS)

    def _close_when_idle(self) -> None:
        """Close the session once it has gone --session-idle-timeout seconds without a step (0: never)."""
        timeout = self.server.idle_timeout
        if self._closed or not timeout:
            return
        idle = time.monotonic() - self.last_active
        if idle >= timeout and not self.busy:
            self.close(reason="idle")
            return
        wait = timeout - idle if idle < timeout else timeout  # a step running: look again later
        self._idle_timer = asyncio.get_running_loop().call_later(wait, self._close_when_idle)

    def close(self, reason: Optional[str] = None) -> None:
        """End the session: by its client (reason None), or by the server ("idle", "reclaimed", "evicted")."""
        if not self._closed:
            self._closed, self.closed_because, self.parked = True, reason, False
            if reason is not None:
                metrics.SESSIONS_CLOSED.labels(reason).inc()
                logger.info("closed a session of peer %s (%s), freeing %d cache tokens", self.peer_id, reason,
                            self.cache.private_pages * PAGE_TOKENS)
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            self.ended.set()
            self._idle.set()  # a fork waiting for it sees it closed
            if self._early is not None:
                self._early.result.cancel()
            if not self._in_flight:  # otherwise once the compute thread is done with its step (see _settled)
                self._give_back_cache()
            self.server.open_sessions.discard(self)
            metrics.SESSIONS.dec()
            self.server.parking.on_close(self)

