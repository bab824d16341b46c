"""A client's one view of each model's servers, shared by all its sessions and refreshed in the background.

Every routing decision used to look the servers up in the DHT: a session's opening, each failover, each re-route.
A gateway opening sessions by the dozen, or a burst of failovers after a server died, then read the same records
over and over (each lives 30 s: three announce periods). Here a model's servers are looked up once and shared: a
background task looks them up again while sessions use the model (a view left unused for IDLE_SECONDS is
dropped), concurrent callers wait for the one lookup in flight, and a caller looks up itself only when the view
is older than it accepts (`max_age`): a session's opening accepts the view's refresh period and a second, a
re-plan after a failure REPLAN_MAX_AGE (what a record lives), so failovers re-plan from the view without a lookup
of their own. A record leaves the view when it expires, as it leaves the DHT.

A view is refreshed every second up to 100 servers and a second more per 100 (at most every announce period,
10 s, where records change no faster): a lookup's bytes grow with the servers it finds (bench.scale: 2 MB at 100
servers, 10 MB at 1,000), and a refresh a second would cost a gateway 10 MB/s at 1,000; every 10 s, 1 MB/s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

from swarm.protocol import RemoteServer

logger = logging.getLogger(__name__)

REFRESH_SECONDS = 1.0  # the least period between a view's lookups in the background
REFRESH_SLACK = 0.1  # a view this near its period is refreshed at this tick rather than a whole tick late
SERVERS_PER_REFRESH_SECOND = 100  # a view of N servers is refreshed every N / 100 s, within these bounds
MOST_REFRESH_SECONDS = 10.0  # an announce period: a server's record changes no faster
OPENING_MARGIN = 1.0  # an opening accepts the view this much older than its refresh period: a view in use is fresh
IDLE_SECONDS = 60.0
REPLAN_MAX_AGE = 30.0  # a record's life (three announce periods of 10 s)

Fetch = Callable[[str, int, frozenset], Awaitable[list[RemoteServer]]]  # (prefix, num_blocks, allowed servers)
Model = tuple[str, int, frozenset]


@dataclass
class _ModelView:
    servers: list[RemoteServer] = field(default_factory=list)
    fetched: float = float("-inf")  # time.monotonic() of the lookup the servers come from
    used: float = 0.0
    pending: Optional[asyncio.Future] = None  # the lookup in flight, which every caller waits for

    def period(self, least: float) -> float:
        """Seconds between its lookups in the background: more, the more servers a lookup brings back."""
        return max(least, min(len(self.servers) / SERVERS_PER_REFRESH_SECOND, MOST_REFRESH_SECONDS))


class SwarmView:
    """The servers of each model (prefix, num_blocks), as `fetch` (a coroutine function) finds them: one view per
    set of servers a client allows (a private swarm's; empty: any), which a client may change. Runs on `loop` (a
    dht.EventLoop): `servers` may be called from any thread."""

    def __init__(self, loop, fetch: Fetch, refresh_seconds: float = REFRESH_SECONDS,
                 idle_seconds: float = IDLE_SECONDS):
        self.loop, self.fetch = loop, fetch
        self.refresh_seconds, self.idle_seconds = refresh_seconds, idle_seconds
        self.lookups = 0  # lookups made, in the background or for a caller
        self._views: dict[Model, _ModelView] = {}
        self._refresher: Optional[asyncio.Task] = None

    def servers(self, prefix: str, num_blocks: int, max_age: Optional[float] = None,
                allowed: frozenset = frozenset()) -> list[RemoteServer]:
        """The model's servers (only those in `allowed`, if any), from a lookup at most `max_age` seconds old (0: a
        lookup now, or the one in flight; None: what an opening accepts, the view's refresh period and a second:
        a view in use is always that fresh, and openings never wait)."""
        return self.loop.run(self._servers((prefix, num_blocks, frozenset(allowed)), max_age))

    async def _servers(self, model: Model, max_age: Optional[float]) -> list[RemoteServer]:
        view = self._views.setdefault(model, _ModelView())
        view.used = time.monotonic()
        if self._refresher is None:
            self._refresher = asyncio.ensure_future(self._refresh_forever())
        if max_age is None:
            max_age = view.period(self.refresh_seconds) + OPENING_MARGIN
        servers = view.servers if time.monotonic() - view.fetched <= max_age else await self._refresh(model, view)
        now = time.time()  # DHT time: a record the view holds leaves it when it expires, as it leaves the DHT
        return [server for server in servers if server.expires > now]

    async def _refresh(self, model: Model, view: _ModelView) -> list[RemoteServer]:
        if view.pending is None:
            view.pending = asyncio.ensure_future(self._look_up(model, view))
        return await asyncio.shield(view.pending)  # a caller that gives up does not cancel the others' lookup

    async def _look_up(self, model: Model, view: _ModelView) -> list[RemoteServer]:
        try:
            self.lookups += 1
            began = time.monotonic()
            view.servers = await self.fetch(*model)
            view.fetched = began  # as old as the moment it was asked: records may have changed meanwhile
            return view.servers
        finally:
            view.pending = None

    async def _refresh_forever(self) -> None:
        """Refresh every view in use when its period has passed; ends once none is in use (the next caller starts
        it again)."""
        while self._views:
            await asyncio.sleep(self.refresh_seconds)
            for model, view in list(self._views.items()):
                if time.monotonic() - view.used > self.idle_seconds:
                    del self._views[model]
                    continue
                if time.monotonic() - view.fetched < view.period(self.refresh_seconds) - REFRESH_SLACK:
                    continue
                try:
                    await self._refresh(model, view)
                except Exception as error:  # the DHT unreachable a moment: callers look up themselves when due
                    logger.debug("refreshing the servers of %s failed: %r", model[0], error)
        self._refresher = None

    def close(self) -> None:
        if self._refresher is not None:
            self.loop.loop.call_soon_threadsafe(self._refresher.cancel)
            self._refresher = None
