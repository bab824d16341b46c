"""Parked sessions: finished conversations and saved prefixes that clients keep warm on a block server for
reuse, within a bounded share of its cache.

A client parks a session (ServerSession.park) when it has no step to send but may come back to it (the next
request of a chat, a saved prefix to fork). A parked session is closed by the server, with reason "evicted",
least recently used first:
- whenever another session (of any peer, its own included) needs cache that is not free, before it waits or is
  refused (Backend.take_cache), or a peer at its limit of open sessions opens another;
- whenever parked sessions together hold more than --warm-cache-share of the cache (0: none is kept);
- whenever one peer's parked sessions claim more than the whole cache (see below): that peer's own go.
A session with a step running, or not parked, is never evicted. What a parked session "holds" is the pages
only parked sessions hold: a page it shares with a session in use (a saved prefix with its forks) comes back
to nobody when it is evicted, so evicting it would only lose the prefix. Its client's next step finds no
session and replays its inputs elsewhere or here (swarm/client/remote_session.py): the outputs are the same.

Two measures, each exact and kept as sessions park, un-park and close, never by a scan of the others:
- parked tokens: the pages that only parked sessions hold, counted once however many forks share them (the
  pool keeps the count page by page, swarm/server/cache.py): what evicting them all would free. The warm share
  bounds it, the server announces it as room (Backend.cache_tokens_available) and rpc_info reports it.
- claimed tokens, per peer: the pages of each of its parked sessions, a shared page once per session that holds
  it. It is the work that parking, un-parking and evicting them costs (each touches its own page table), so a
  peer's claim is bounded by the whole cache: 255 parked forks of one 8,192-token prefix hold one prefix of
  pages, but would cost an eviction 255 page tables; past the bound, that peer's least recently used go first.
Parking a session costs its own pages, un-parking and closing likewise, and reading either count nothing.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Optional

from swarm.server.cache import PAGE_TOKENS, CacheBudget, KVPool
from swarm.server.sessions import Parking, ServerSession

logger = logging.getLogger(__name__)


class WarmSessions(Parking):
    """The parked sessions of a server, and the share of the cache they may keep. Sessions tell it when they
    park, stop being parked, or close (Parking)."""

    def __init__(self, budget: CacheBudget, share: float, pool: Callable[[], KVPool]):
        self.budget, self.share = budget, share
        self._pool = pool  # the span's pool: every parked session's pages are in it (Backend.move_to)
        self._claims: dict[ServerSession, int] = {}  # each parked session, and the tokens of its page tables
        self._claimed: Counter[str] = Counter()  # tokens claimed by each peer's parked sessions
        self._trimming = False  # evicting closes sessions, which tells trim again: once is enough

    @property
    def count(self) -> int:
        """Parked sessions (those with a step running included)."""
        return len(self._claims)

    def parked(self, peer_id: Optional[str] = None) -> list[ServerSession]:
        """Parked sessions (of `peer_id`, if given) that may be evicted now, least recently active first."""
        return sorted((session for session in self._claims if not session.busy and peer_id in (None, session.peer_id)),
                      key=lambda session: session.last_active)

    def parked_tokens(self) -> int:
        """Cache slots of the pages that only parked sessions hold: what evicting them all would free."""
        return self._pool().parked_only_pages * PAGE_TOKENS

    def claimed_tokens(self, peer_id: str) -> int:
        """Tokens of the page tables of `peer_id`'s parked sessions (shared pages once per session)."""
        return self._claimed[peer_id]

    def on_park(self, session: ServerSession) -> None:
        claim = session.cache.pages * PAGE_TOKENS
        self._claims[session] = claim
        self._claimed[session.peer_id] += claim
        session.cache.set_parked(True)
        self._bound_claim(session.peer_id)
        self.trim()

    def on_unpark(self, session: ServerSession) -> None:
        claim = self._claims.pop(session, None)
        if claim is None:
            return
        self._claimed[session.peer_id] -= claim
        if self._claimed[session.peer_id] <= 0:
            del self._claimed[session.peer_id]
        session.cache.set_parked(False)

    def on_close(self, session: ServerSession) -> None:
        self.on_unpark(session)
        self.trim()  # pages it shared with parked sessions may now be theirs alone

    def trim(self) -> None:
        """Evict parked sessions, least recently used first, while they hold more than their share."""
        if self._trimming:
            return
        self._trimming = True
        try:
            bound = self.share * self.budget.total
            if self.share == 0:  # none is kept, whatever it holds
                for session in self.parked():
                    session.close(reason="evicted")
            elif self.parked_tokens() > bound:
                self._evict(self.parked(), lambda: self.parked_tokens() <= bound)
        finally:
            self._trimming = False

    def make_room(self, enough: Callable[[], bool], peer_id: Optional[str] = None) -> None:
        """Evict parked sessions (of `peer_id`, if given), least recently used first, until `enough()`."""
        if not enough():
            self._evict(self.parked(peer_id), enough)

    def evict_one(self, peer_id: str) -> bool:
        """Evict `peer_id`'s least recently used parked session, whatever it holds (the peer is at its limit of
        open sessions). Whether there was one."""
        parked = self.parked(peer_id)
        if parked:
            parked[0].close(reason="evicted")
        return bool(parked)

    def close_all(self) -> None:
        """Evict every parked session (the server moved to other blocks: none of them can step again)."""
        for session in list(self._claims):
            session.close(reason="evicted")

    def _bound_claim(self, peer_id: str) -> None:
        """Evict `peer_id`'s least recently used parked sessions while they claim more than the whole cache."""
        if self._claimed[peer_id] <= self.budget.total:
            return
        for session in self.parked(peer_id):
            if self._claimed[peer_id] <= self.budget.total:
                return
            session.close(reason="evicted")

    def _evict(self, candidates: list[ServerSession], enough: Callable[[], bool]) -> None:
        """Evict candidates in order until `enough()`, skipping those whose pages all live on in sessions in use
        (evicting one would free nothing)."""
        for session in candidates:
            if enough():
                return
            if session.cache.holds_parked_only():
                session.close(reason="evicted")
