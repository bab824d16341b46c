"""Parked sessions: finished conversations and saved prefixes that clients keep warm on a block server for
reuse, within a bounded share of its cache.

A client parks a session (ServerSession.park) when it has no step to send but may come back to it (the next
request of a chat, a saved prefix to fork). A parked session is closed by the server, with reason "evicted",
least recently used first:
- whenever another session (of any peer, its own included) needs cache that is not free, before it waits or is
  refused (Backend.take_cache), or a peer at its limit of open sessions opens another;
- whenever parked sessions together hold more than --warm-cache-share of the cache (0: none is kept).
A session with a step running, or not parked, is never evicted. What a parked session "holds" is the pages
only parked sessions hold: a page it shares with a session in use (a saved prefix with its forks) comes back
to nobody when it is evicted, so evicting it would only lose the prefix. Its client's next step finds no
session and replays its inputs elsewhere or here (swarm/client/remote_session.py): the outputs are the same.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Iterable, Optional

from swarm.server.cache import PAGE_TOKENS, CacheBudget
from swarm.server.sessions import OpenSessions, ServerSession

logger = logging.getLogger(__name__)


class WarmSessions:
    """The parked sessions of a server's OpenSessions, and the share of the cache they may keep."""

    def __init__(self, sessions: OpenSessions, budget: CacheBudget, share: float):
        self.sessions, self.budget, self.share = sessions, budget, share
        self._trimming = False  # evicting closes sessions, which tells trim again: once is enough

    def parked(self, peer_id: Optional[str] = None) -> list[ServerSession]:
        """Parked sessions (of `peer_id`, if given) that may be evicted now, least recently active first."""
        return sorted((session for session in self.sessions
                       if session.parked and not session.busy and peer_id in (None, session.peer_id)),
                      key=lambda session: session.last_active)

    def parked_tokens(self) -> int:
        """Cache slots of the pages that only parked sessions hold: what evicting them all would free."""
        return len(self._parked_only_pages(self.parked())) * PAGE_TOKENS

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
            else:
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

    def _evict(self, candidates: list[ServerSession], enough: Callable[[], bool]) -> None:
        """Evict candidates in order until `enough()`, skipping those whose pages all live on in sessions in use
        (evicting one would free nothing)."""
        for session in candidates:
            if enough():
                return
            if self._parked_only_pages([session], among=self.parked()):
                session.close(reason="evicted")

    def _parked_only_pages(self, sessions: Iterable[ServerSession], among: Optional[list] = None) -> set:
        """Pages (pool, page) of `sessions` that no session but the parked ones (`among`, default: `sessions`)
        holds. Keyed by pool too: after a move to other blocks, old sessions hold pages of the old pool."""
        sessions = list(sessions)
        among = sessions if among is None else among
        holders = Counter(_pages(among))
        return {(pool, page) for pool, page in set(_pages(sessions)) if holders[pool, page] == pool.holders(page)}


def _pages(sessions: Iterable[ServerSession]) -> Iterable[tuple]:
    for session in sessions:
        for table in session.cache.tables:
            for page in table:
                yield session.cache.pool, page
