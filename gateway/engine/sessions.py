"""The open inference sessions of one gateway process: caps on their number (overall, and per client: an API
key, or an address; see access.client_id), and expiry of idle ones.

Expired sessions are closed actively, so the block servers free their caches at once rather than when a
client comes back. A session serves one request at a time; a second one at once is refused (409).

Who may use a session by its id (the Petals HTTP API's): when the gateway has API keys, only the key that opened
it (another key gets the same 404 as an unknown id, as for stored responses: `visible_to`); without keys a caller
is only its address, which proves nothing, so the id (random, unguessable) is what grants access.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

from gateway.errors import NotFound, SessionBusy, TooManySessions

logger = logging.getLogger(__name__)


def visible_to(owner: str, client: str) -> bool:
    """Whether `client` may use what `owner` made (both access.client_id()s): keys identify callers, addresses
    do not (see the module docstring)."""
    return not owner.startswith("key:") or owner == client


class SessionRegistry:
    def __init__(self, max_sessions: int, idle_timeout: float, max_per_client: int | None = None):
        self.max_sessions, self.idle_timeout = max_sessions, idle_timeout
        self.max_per_client = max_per_client or max_sessions
        self._sessions: dict = {}  # id -> engine.GatewaySession
        self._opening: Counter[str] = Counter()  # per client: slots held by sessions still contacting servers
        self._lock = threading.Lock()
        self._reaper: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self._sessions)

    def _held_by(self, owner: str) -> int:
        return self._opening[owner] + sum(1 for session in list(self._sessions.values()) if session.owner == owner)

    @contextmanager
    def reserve(self, owner: str) -> Iterator[None]:
        """Hold a slot under both caps while `owner`'s session opens (that takes network round trips), or while a
        request of `owner`'s that needs no session runs its cache-less forwards (embeddings: web/limits.work_slot)."""
        with self._lock:
            if len(self._sessions) + self._opening.total() >= self.max_sessions:
                raise TooManySessions(f"too many open inference sessions ({self.max_sessions}, MAX_SESSIONS); "
                                      "close one or retry later")
            if self._held_by(owner) >= self.max_per_client:
                raise TooManySessions(f"this client holds {self.max_per_client} open inference sessions, the most "
                                      "it may (MAX_SESSIONS_PER_CLIENT); close one or retry later")
            self._opening[owner] += 1
        try:
            yield
        finally:
            with self._lock:
                self._opening[owner] -= 1
                if not self._opening[owner]:
                    del self._opening[owner]

    def add(self, session) -> None:
        with self._lock:
            self._sessions[session.id] = session
            if self._reaper is None:  # started lazily: never in a gunicorn master, never at import
                self._reaper = threading.Thread(target=self._reap_forever, name="session-reaper", daemon=True)
                self._reaper.start()

    def get(self, session_id: str, client: str | None = None):
        """The session; with `client`, only if that client may use it (visible_to)."""
        session = self._sessions.get(session_id)
        if session is None or (client is not None and not visible_to(session.owner, client)):
            raise NotFound(f"unknown inference session {session_id!r} (closed, expired or never opened)",
                           field="session_id")
        return session

    def remove(self, session) -> None:
        with self._lock:
            self._sessions.pop(session.id, None)

    @contextmanager
    def use(self, session_id: str, client: str | None = None):
        """The session, held for one request (of `client`'s, when given: see get)."""
        session = self.get(session_id, client)
        if not session.lock.acquire(blocking=False):
            raise SessionBusy(f"inference session {session_id} is busy with another request", field="session_id")
        try:
            yield session
        finally:
            session.last_used = time.monotonic()
            session.lock.release()

    def expire_idle(self) -> int:
        """Close every expiring session idle for longer than the timeout and not in use; return how many."""
        now, expired = time.monotonic(), 0
        for session in list(self._sessions.values()):
            if session.expires and now - session.last_used > self.idle_timeout and session.lock.acquire(False):
                try:
                    self.remove(session)
                    session.close()
                    expired += 1
                    logger.info("closed inference session %s after %.0f s idle", session.id, now - session.last_used)
                finally:
                    session.lock.release()
        return expired

    def _reap_forever(self) -> None:
        while True:
            time.sleep(min(max(self.idle_timeout / 4, 0.2), 5.0))
            try:
                self.expire_idle()
            except Exception:
                logger.exception("expiring sessions failed")
