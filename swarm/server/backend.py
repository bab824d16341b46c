"""The block server's backend: what the RPC handlers call. It checks every request against the span and the
limits on one client, opens sessions within the cache budget (each gets ServerServices: what it uses of the
server), and submits cache-less forwards to the compute thread as jobs (sessions submit their steps)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Optional

import torch

from swarm.protocol import (PROTOCOL_VERSION, BadRequestError, ServerLimitError, SessionClosedError, SessionLengthError,
                            SwarmError)
from swarm.server.batching import Scheduler
from swarm.server.cache import PAGE_TOKENS, CacheBudget, SessionCache, pages_for
from swarm.server.fields import declared_positions, int_field, is_int
from swarm.server.open_sessions import OpenSessions
from swarm.server.sessions import ServerServices, ServerSession
from swarm.server.settings import ServerLimits
from swarm.server.span import BlockSpan
from swarm.server.step_batch import run_steps, start_pushed
from swarm.server.warm import WarmSessions

MAX_BATCH_SIZE = 64
# what hidden states may travel as (config.WIRE_DTYPES); any other dtype is refused before it reaches a batch
HIDDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

logger = logging.getLogger(__name__)


class Backend:
    """What the RPC handlers call: validates requests against the span and the limits, submits them to the
    compute thread (swarm/server/batching.py), and keeps the sessions' caches within the budget."""

    def __init__(self, span: BlockSpan, budget: CacheBudget, limits: ServerLimits = ServerLimits(), **batching):
        self.span, self.budget, self.limits = span, budget, limits
        span.new_pool(budget.total)  # the pages the budget's slots stand for
        self.hidden_size = span.config.hidden_size
        self.max_positions = span.max_positions
        self.scheduler = Scheduler(lambda: self.span, **batching)
        self.sessions = OpenSessions()
        # parked sessions (see warm.py): all of them hold pages of the span's pool (move_to evicts them)
        self.warm = WarmSessions(budget, limits.warm_cache_share, lambda: self.span.pool)
        self.cache_by_peer: Counter[str] = Counter()  # cache slots each peer's sessions hold or wait for (> 0)
        # forwards longer than a chunk run one at a time: each holds a temporary cache (see _forward_in_chunks)
        self._long_forwards = asyncio.Semaphore(1)

    def move_to(self, span: BlockSpan) -> None:
        """Serve another span from now on; open sessions end (their clients fail over to other servers). Its
        pool comes first: if it cannot be had (out of memory), nothing has changed and the old span serves on.
        Work submitted for the old span fails with an error the client retries (Scheduler._without_stale)."""
        span.new_pool(self.budget.total)  # the evicted sessions give their pages back to the old span's pool
        self.warm.close_all()  # parked: nobody is stepping them, and none can step here again
        for session in list(self.sessions):
            session.evicted = True
        self.span = span

    @property
    def cache_tokens_available(self) -> int:
        """What a new session may have: the free cache, and what parked sessions would give back if evicted."""
        return self.budget.free + self.warm.parked_tokens()

    def info(self) -> dict:
        return {
            "start": self.span.start,
            "end": self.span.end,
            "dtype": str(self.span.dtype).removeprefix("torch."),
            "quantization": self.span.quantization,
            "device": str(self.span.device),
            "cache_tokens_free": self.budget.free,
            "cache_pages_used": self.span.pool.pages - self.span.pool.free_pages,
            "cache_pages_shared": self.span.pool.shared_pages,  # held by several sessions (forks): copy-on-write
            "parked_sessions": self.warm.count,
            "parked_tokens": self.warm.parked_tokens(),
            "positions_served": self.sessions.positions_served,
            "steps_pushed": self.sessions.steps_pushed,
            "version": PROTOCOL_VERSION,
            "loaded_names": self.span.loaded_names,
            "adapters": sorted(self.span.adapters),
        }

    async def forward(self, tensors: list, metadata: dict) -> torch.Tensor:
        """Cache-less sequences (from position 0, nothing kept) through blocks [start, end). They go through the
        compute thread's rounds like prompts, a chunk at a time, so that decoding sessions wait for one chunk at
        most."""
        start, end = self._block_range(metadata)
        adapter = self._adapter(metadata)
        hidden = await self.check_hidden_states(tensors)
        rows, length = hidden.shape[:2]
        if length > self.max_positions:
            raise SessionLengthError(f"sequence of {length} tokens exceeds {self.max_positions} positions")
        chunk = self.scheduler.prefill_chunk_tokens
        if length <= chunk:  # a sequence fits a chunk: no cache needed, a chunk's worth of rows at a time
            rows_per_job = chunk // length
            parts = await asyncio.gather(*(self.scheduler.submit(hidden[first : first + rows_per_job], 0, start, end,
                                                                 adapter=adapter)
                                           for first in range(0, rows, rows_per_job)))
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        async with self._long_forwards:
            return await self._forward_in_chunks(hidden, start, end, adapter)

    async def _forward_in_chunks(self, hidden: torch.Tensor, start: int, end: int, adapter: Optional[str]
                                 ) -> torch.Tensor:
        """A forward longer than a chunk, computed like a prompt through a temporary cache of its length: the
        same outputs as one unchunked pass. The cache comes from the budget like a session's, waiting up to
        --cache-wait, then refused with CacheFullError: the pool is the only memory attention reads keys from,
        and a server must not hold more than its operator gave it. One such forward at a time, so that a
        flood of them queued for the compute thread holds one temporary cache, not the sessions' room. The
        scheduler gives the cache back once no round can write it any more: after the forward ends, fails, or
        is dropped because its caller hung up."""
        rows, positions = hidden.shape[0], pages_for(hidden.shape[1]) * PAGE_TOKENS
        await self.budget.take(rows * positions, self.limits.cache_wait)
        try:
            cache = self.span.new_cache(rows, positions)
        except BaseException:
            self.budget.give_back(rows * positions)
            raise

        def give_back() -> None:
            cache.release()
            self.budget.give_back(rows * positions)

        return await self.scheduler.submit(hidden, 0, start, end, cache, on_settled=give_back, adapter=adapter)

    async def open_session(self, metadata: dict, peer_id: str) -> ServerSession:
        """A new session for peer `peer_id`, holding its first page of cache (refused with CacheFullError if
        none frees up, or ServerLimitError past the limits on one client)."""
        start, end = self._block_range(metadata)
        adapter = self._adapter(metadata)
        max_length = int_field(metadata, "max_length", 1, self.max_positions)
        batch_size = int_field(metadata, "batch_size", 1, MAX_BATCH_SIZE)
        next_positions = declared_positions(metadata, max_length)  # what its first step may be pushed with
        session_id = metadata.get("session_id")
        if session_id is not None and not (isinstance(session_id, str) and 16 <= len(session_id) <= 64):
            raise BadRequestError("field 'session_id' must be a string of 16 to 64 characters (a random token)")
        if session_id in self.sessions.by_id or self.sessions.closed(session_id):
            raise BadRequestError("field 'session_id' is already in use, or was: a session id is used once")
        if max_length * batch_size > self.limits.max_session_tokens:
            raise ServerLimitError(f"a session of max_length {max_length} x batch_size {batch_size} is over this "
                                   f"server's limit of {self.limits.max_session_tokens} tokens per session")
        self._check_session_count(peer_id)
        fork = metadata.get("fork")
        if fork is not None:  # the pages of the source's first positions, shared
            cache, length = await self._forked_cache(fork, peer_id, (start, end, batch_size, adapter), max_length)
        else:  # an empty cache: it takes pages as the session grows
            cache, length = self.span.new_cache(batch_size), 0
        services = ServerServices(self.sessions, self.check_hidden_states, self.run_steps, self.take_cache,
                                  self.take_cache_now, self.give_back_cache, self.limits.session_idle_timeout,
                                  self.warm)
        session = ServerSession(services, cache, start, end, max_length, batch_size, peer_id, session_id, length,
                                adapter, next_positions)
        try:
            if not cache.pages:  # its first page (a fork pays for its pages as it writes)
                await session.reserve(0, 1)
        except BaseException:
            session.close()
            raise
        return session

    def _check_session_count(self, peer_id: str) -> None:
        """Refuse a session past the peer's limit of open ones, unless one of its parked sessions makes way."""
        if self.sessions.per_peer[peer_id] >= self.limits.max_sessions_per_peer and not self.warm.evict_one(peer_id):
            raise ServerLimitError(f"peer {peer_id} has {self.sessions.per_peer[peer_id]} sessions open on this "
                                   f"server already, its limit per peer")

    async def _forked_cache(self, fork, peer_id: str, shape: tuple, max_length: int) -> tuple[SessionCache, int]:
        """A fork's cache, sharing its source's pages, and its length; `shape` is the new session's (start, end,
        batch size, adapter). The count of the peer's sessions is checked again once the source let it fork:
        others may have opened while it waited."""
        length = _fork_length(fork, max_length)
        cache = await self._fork_source(fork, peer_id, shape).fork_cache(length)
        try:
            self._check_session_count(peer_id)
        except ServerLimitError:  # the source may have closed meanwhile: what this cache alone held is freed
            self.give_back_cache(peer_id, cache.release() * PAGE_TOKENS)
            raise
        return cache, length

    def _fork_source(self, fork: dict, peer_id: str, shape: tuple) -> ServerSession:
        """The open session a new one forks: the same peer's, over the same blocks, with the same batch size and
        adapter (a cache computed through one adapter means nothing to another)."""
        source = self.sessions.by_id.get(fork.get("session_id")) if isinstance(fork.get("session_id"), str) else None
        if source is None or source.peer_id != peer_id:  # another peer's session reads as no session at all
            raise BadRequestError("field 'fork.session_id' names no open session of yours on this server")
        start, end, batch_size, adapter = shape
        if (source.start, source.end, source.batch_size, source.adapter) != shape:
            raise BadRequestError(f"a fork must have its source's blocks, batch size and adapter: {source.start}:"
                                  f"{source.end} x {source.batch_size} ({source.adapter}), got {start}:{end} x "
                                  f"{batch_size} ({adapter})")
        return source

    async def take_cache(self, peer_id: str, tokens: int) -> None:
        """`tokens` cache slots for a session of `peer_id`, waiting up to --cache-wait for them.

        One peer may hold at most its share of the cache (--max-cache-share-per-peer, but never less than one
        session of --max-session-tokens) while other peers hold some too: past it, it is refused with
        ServerLimitError, and its client routes elsewhere. A peer alone on the server may use all of it (a
        gateway on its own small swarm), but a peer within its share that finds the cache full then gets room
        from the idle sessions of peers that hold at least as much, least recently active first: a peer that
        came first and opened sessions it never steps cannot keep others out, nor can several identities that
        each hold their share (see _reclaim). Parked sessions (swarm/server/warm.py) make way before any of
        that: the peer's own when it is at its share, anyone's when the cache is full."""
        limit = self.peer_cache_limit()
        held = self.cache_by_peer[peer_id]
        shared_with_others = any(other != peer_id for other in self.cache_by_peer)
        if held + tokens > limit and shared_with_others:  # its own parked sessions make way first
            self.warm.make_room(lambda: self.cache_by_peer[peer_id] + tokens <= limit, peer_id)
            held = self.cache_by_peer[peer_id]
        if held + tokens > limit and shared_with_others:
            raise ServerLimitError(
                f"peer {peer_id} holds {held} of this server's {self.budget.total} cache tokens: {tokens} more would "
                f"be over its share of {limit} while other peers use this server; try another server")
        self.warm.make_room(lambda: self.budget.free >= tokens)  # parked sessions of any peer, before anyone else's
        if tokens > self.budget.free and held + tokens <= limit:
            self._reclaim(peer_id, tokens)
        self.cache_by_peer[peer_id] += tokens  # before the wait: the peer's other sessions see it
        try:
            await self.budget.take(tokens, self.limits.cache_wait)
        except BaseException:
            self._uncount(peer_id, tokens)
            raise

    def take_cache_now(self, peer_id: str, tokens: int) -> bool:
        """take_cache where it needs neither a wait nor anybody to make room: whether it took them."""
        shared_with_others = any(other != peer_id for other in self.cache_by_peer)
        if shared_with_others and self.cache_by_peer[peer_id] + tokens > self.peer_cache_limit():
            return False
        if not self.budget.take_now(tokens):
            return False
        self.cache_by_peer[peer_id] += tokens
        return True

    async def run_steps(self, items: list) -> list:
        """Steps of sessions [(session, hidden, metadata)], checked, as one batch: each one's outputs or error
        (swarm/server/step_batch.py)."""
        return await run_steps(self.scheduler.submit_batch, items)

    def give_back_cache(self, peer_id: str, tokens: int) -> None:
        self.budget.give_back(tokens)
        self._uncount(peer_id, tokens)

    def peer_cache_limit(self) -> int:
        return max(int(self.limits.max_cache_share_per_peer * self.budget.total), self.limits.max_session_tokens)

    def _reclaim(self, peer_id: str, tokens: int) -> None:
        """Close idle sessions, least recently active first, of peers that hold at least as much as `peer_id`
        will once it has its `tokens`, until they fit. Not only peers over their share: two identities that
        each hold exactly their share in sessions they never step would otherwise keep a third out; and never
        a peer that holds less, so that no peer is pushed below the one taking its room."""
        wanted = self.cache_by_peer[peer_id] + tokens
        others = sorted((session for session in self.sessions if session.peer_id != peer_id and not session.busy),
                        key=lambda session: session.last_active)
        for session in others:
            if self.budget.free >= tokens:
                return
            if self.cache_by_peer[session.peer_id] >= wanted:
                session.close(reason="reclaimed")

    def _uncount(self, peer_id: str, tokens: int) -> None:
        self.cache_by_peer[peer_id] -= tokens
        if self.cache_by_peer[peer_id] <= 0:
            del self.cache_by_peer[peer_id]

    def accept_pushes(self, pushes: list) -> list:
        """Steps' inputs pushed by the previous server of clients' chains [(hidden or its refusal, entry)],
        started at once where they continue their sessions (see ServerSession.pushed): each one's refusal, or
        None."""
        refusals, items, places = [None] * len(pushes), [], []
        for index, (hidden, entry) in enumerate(pushes):
            try:
                session_id = entry.get("session_id") if isinstance(entry, dict) else None
                session = self.sessions.by_id.get(session_id) if isinstance(session_id, str) else None
                if session is None and self.sessions.closed(session_id):  # a late push: nothing is allocated
                    raise SessionClosedError("the session with this 'session_id' is closed")
                if session is None:
                    raise BadRequestError("no open session has this 'session_id'")
                if isinstance(hidden, SwarmError):  # refused undecoded, or not as the message declared
                    raise hidden
                items.append((session, self.checked_hidden(hidden, session.batch_size), entry))
                places.append(index)
            except SwarmError as error:
                refusals[index] = error
        for index, refusal in zip(places, start_pushed(self.scheduler.enqueue_batch, items)):
            refusals[index] = refusal
        return refusals

    def close(self) -> None:
        self.scheduler.stop()

    def _adapter(self, metadata: dict) -> Optional[str]:
        """The LoRA adapter a request names (field 'adapter'), one this server applies; None: the base model."""
        adapter = metadata.get("adapter")
        if adapter is not None and (not isinstance(adapter, str) or adapter not in self.span.adapters):
            held = ", ".join(sorted(self.span.adapters)) or "none"
            raise BadRequestError(f"field 'adapter': this server has no adapter {adapter!r:.80} (it has: {held})")
        return adapter

    def _block_range(self, metadata: dict) -> tuple[int, int]:
        start = int_field(metadata, "start", self.span.start, self.span.end - 1)
        end = int_field(metadata, "end", start + 1, self.span.end)
        return start, end

    async def check_hidden_states(self, tensors: list, batch_size: int | None = None) -> torch.Tensor:
        """The one tensor of hidden states a request carries, refused unless a span can run it as it is."""
        if len(tensors) != 1:
            raise BadRequestError(f"expected one tensor of hidden states, got {len(tensors)}")
        return self.checked_hidden(tensors[0], batch_size)

    def checked_hidden(self, hidden: torch.Tensor, batch_size: int | None = None) -> torch.Tensor:
        """`hidden`, refused unless a span can run it as it is (of a session of `batch_size` rows, if given).
        Whether it is finite is checked on the device, in its round (batching.py)."""
        if hidden.ndim != 3 or hidden.shape[2] != self.hidden_size or hidden.shape[1] < 1 or hidden.shape[0] < 1:
            raise BadRequestError(
                f"hidden states must have shape (batch, length >= 1, {self.hidden_size}), got {tuple(hidden.shape)}"
            )
        if batch_size is not None:
            check_rows(hidden, batch_size)
        if hidden.dtype not in HIDDEN_DTYPES:
            raise dtype_refusal(hidden.dtype)
        tokens = hidden.shape[0] * hidden.shape[1]
        if tokens > self.limits.max_request_tokens:
            raise BadRequestError(f"a request of {hidden.shape[0]} x {hidden.shape[1]} tokens is over this server's "
                                  f"limit of {self.limits.max_request_tokens} tokens per request")
        return hidden.detach()  # a request may say requires_grad: nothing here needs a graph


def typed_steps(tensors: list, steps: list) -> list:
    """A message's steps (views of its one tensor, `tensors`), each refused in its place unless its tensor is of
    a dtype hidden states travel as; whether they are finite is checked on the device, in their round."""
    if not tensors or isinstance(tensors[0], SwarmError) or tensors[0].dtype in HIDDEN_DTYPES:
        return steps
    refusal = dtype_refusal(tensors[0].dtype)
    return [refusal if not isinstance(step, SwarmError) else step for step in steps]


def dtype_refusal(dtype: torch.dtype) -> BadRequestError:
    names = ", ".join(str(allowed).removeprefix("torch.") for allowed in HIDDEN_DTYPES)
    return BadRequestError(f"hidden states must be floating point ({names}), got {dtype}")


def check_rows(hidden: torch.Tensor, batch_size: int) -> None:
    if hidden.shape[0] != batch_size:
        raise BadRequestError(f"this session has batch size {batch_size}, got {hidden.shape[0]}")


def _fork_length(fork, max_length: int) -> int:
    """How many of its source's first positions a fork shares, from the opening's field 'fork'."""
    if not isinstance(fork, dict):
        raise BadRequestError("field 'fork' must be a map with a 'session_id' and a 'length'")
    length = fork.get("length")
    if not is_int(length) or not 0 <= length <= max_length:
        raise BadRequestError(f"field 'fork.length' must be an integer in [0, {max_length}] (the new session's "
                              f"max_length), got {length!r}")
    return length
