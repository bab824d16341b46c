"""The open inference sessions of one gateway process: caps on their number (overall, and per client: an API
key, or an address; see access.client_id), and expiry of idle ones.

Expired sessions are closed actively, so the block servers free their caches at once rather than when a
client comes back. A session serves one request at a time; a second one at once is refused (409).

Who may use a session by its id (the Petals HTTP API's): when the gateway has API keys, only the key that opened
it (another key gets the same 404 as an unknown id, as for stored responses: `visible_to`); without keys a caller
is only its address, which proves nothing, so the id (random, unguessable) is what grants access.

With a store (session_store.py, SESSION_STORE), every session a client names by id (`keep`) is saved when it opens
and after each request, and its row deleted when it is closed or expires. A request naming a session this process
does not hold (the gateway restarted) reopens the stored one, under the same caps and the same owner check: `get`
does, for every dialect. A WebSocket that ends `detach`es its session: forgotten here, kept in the store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from gateway.errors import NotFound, SessionBusy, TooManySessions
from gateway.engine.session_store import SessionStore, StoredSession

logger = logging.getLogger(__name__)
SHOWN_ID_CHARS = 64  # an unknown id is echoed this far (ours are 36-character uuids)


def visible_to(owner: str, client: str) -> bool:
    """Whether `client` may use what `owner` made (both access.client_id()s): keys identify callers, addresses
    do not (see the module docstring)."""
    return not owner.startswith("key:") or owner == client


class SessionRegistry:
    def __init__(self, max_sessions: int, idle_timeout: float, max_per_client: int | None = None,
                 store: Optional[SessionStore] = None,
                 reopen: Optional[Callable[[StoredSession], object]] = None):
        """`store`: where sessions outlive this process (None: memory only); `reopen(stored) -> GatewaySession`
        opens a stored one on the swarm again (session_store.reopen_session)."""
        self.max_sessions, self.idle_timeout = max_sessions, idle_timeout
        self.max_per_client = max_per_client or max_sessions
        self.store, self.reopen = store, reopen
        self._reopening: dict[str, tuple[threading.Lock, int]] = {}  # id -> (its lock, requests waiting on it)
        self._sessions: dict = {}  # id -> engine.GatewaySession
        # per client: slots held by sessions still contacting servers, by work that opens none, and by the forks of
        # n choices (each fork is a session on the servers: it counts under both caps while it lives)
        self._reserved: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._reaper: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self._sessions)

    def _held_by(self, owner: str) -> int:
        return self._reserved[owner] + sum(1 for session in list(self._sessions.values()) if session.owner == owner)

    @contextmanager
    def reserve(self, owner: str, count: int = 1) -> Iterator[None]:
        """Hold `count` slots under both caps, all or none: while `owner`'s session opens (that takes network round
        trips), while a request of `owner`'s that needs no session runs its cache-less forwards (embeddings:
        web/limits.work_slot), or while the forks of a request's n choices live (choices.py)."""
        with self._lock:
            if count and len(self._sessions) + self._reserved.total() + count > self.max_sessions:
                raise TooManySessions(f"too many open inference sessions ({self.max_sessions}, MAX_SESSIONS); "
                                      "close one or retry later")
            if count and self._held_by(owner) + count > self.max_per_client:
                raise TooManySessions(f"this client holds {self.max_per_client} open inference sessions, the most "
                                      "it may (MAX_SESSIONS_PER_CLIENT); close one or retry later")
            self._reserved[owner] += count
        try:
            yield
        finally:
            with self._lock:
                self._reserved[owner] -= count
                if self._reserved[owner] <= 0:
                    del self._reserved[owner]

    @property
    def held(self) -> int:
        """Slots held under MAX_SESSIONS: open sessions, the forks of n choices, sessions opening."""
        return len(self._sessions) + self._reserved.total()

    def add(self, session) -> None:
        self.save(session)
        with self._lock:
            self._sessions[session.id] = session
            if self._reaper is None:  # started lazily: never in a gunicorn master, never at import
                self._reaper = threading.Thread(target=self._reap_forever, name="session-reaper", daemon=True)
                self._reaper.start()

    def get(self, session_id: str, client: str | None = None):
        """The session; with `client`, only if that client may use it (visible_to). One this process does not
        hold is reopened from the store, if it is there."""
        session = self._sessions.get(session_id)
        if session is None and self.store is not None:
            session = self._reopen_stored(session_id, client)
        if session is None or (client is not None and not visible_to(session.owner, client)):
            shown = session_id if len(session_id) <= SHOWN_ID_CHARS else session_id[:SHOWN_ID_CHARS] + "..."
            raise NotFound(f"unknown inference session {shown!r} (closed, expired or never opened)",
                           field="session_id")  # the id is the client's: echoed whole, it could be the whole body
        return session

    def resume(self, session_id: str, client: str):
        """A stored session this process does not hold, reopened for a new connection (a WebSocket's)."""
        if session_id in self._sessions:
            raise SessionBusy(f"inference session {session_id} is open on another connection; close that one first",
                              field="session_id")
        return self.get(session_id, client)

    def remove(self, session) -> None:
        """Forget the session: closed or expired, so its stored row goes too."""
        with self._lock:
            self._sessions.pop(session.id, None)
        if self.store is not None and session.stored:
            self._store_call("delete", session.id)

    def detach(self, session) -> None:
        """Forget the session but keep it stored (its WebSocket is gone): it may be resumed until it expires."""
        with self._lock:
            self._sessions.pop(session.id, None)
        if self.store is not None and session.stored and not session.closed:
            self._store_call("release", session.id, self.idle_timeout)

    def keep(self, session) -> None:
        """Keep the session in the store from now on (one its client names by id: Petals' HTTP and WebSocket
        sessions; the sessions a stateless request opens for itself are not worth a write)."""
        session.stored = True
        self.save(session)

    def save(self, session) -> None:
        if self.store is not None and session.stored and not session.closed:
            self._store_call("save", session, self.idle_timeout)

    def _store_call(self, method: str, *args) -> None:
        """A write to the store: one that fails (disk full, say) is an error in the log, and the session goes on
        in memory; the request that made it is not failed for it."""
        if self.store is None:
            return
        try:
            getattr(self.store, method)(*args)
        except Exception:
            logger.exception("the session store (SESSION_STORE=%s) failed to %s a session", self.store.path, method)

    def _reopen_stored(self, session_id: str, client: str | None):
        """The stored session, opened on the swarm again in this process; None if there is none for `client`."""
        with self._reopening_lock(session_id):
            if (session := self._sessions.get(session_id)) is not None:
                return session  # another request reopened it meanwhile
            stored = self.store.load(session_id)
            if stored is None or (client is not None and not visible_to(stored.owner, client)):
                return None
            if self.store.held_elsewhere(stored):
                raise SessionBusy(f"inference session {session_id} is open in another process of this gateway",
                                  field="session_id")
            if (stored := self.store.claim(session_id)) is None:
                return None  # expired
            try:
                with self.reserve(stored.owner):
                    session = self.reopen(stored)
                    self.add(session)
            except BaseException:
                self._store_call("release", session_id, max(stored.expires_at - time.time(), 0.0))
                raise
            return session

    @contextmanager
    def _reopening_lock(self, session_id: str) -> Iterator[None]:
        """One reopening per session id at a time (a replay takes a while); other ids go on meanwhile."""
        with self._lock:
            lock, waiting = self._reopening.get(session_id, (threading.Lock(), 0))
            self._reopening[session_id] = (lock, waiting + 1)
        try:
            with lock:
                yield
        finally:
            with self._lock:
                lock, waiting = self._reopening[session_id]
                if waiting == 1:
                    del self._reopening[session_id]
                else:
                    self._reopening[session_id] = (lock, waiting - 1)

    @contextmanager
    def use(self, session_id: str, client: str | None = None):
        """The session, held for one request (of `client`'s, when given: see get)."""
        session = self.get(session_id, client)
        if not session.lock.acquire(blocking=False):
            raise SessionBusy(f"inference session {session_id} is busy with another request", field="session_id")
        try:
            yield session
        finally:
            session.settle()  # a reply left unclosed (an exception on its way up) ends before the session is saved
            session.last_used = time.monotonic()
            try:
                self.save(session)  # what the request left, for a restart to continue from
            finally:
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
        if self.store is not None:
            self.store.sweep()  # rows no process holds any more (a gateway gone, a WebSocket gone) past their time
        return expired

    def _reap_forever(self) -> None:
        while True:
            time.sleep(min(max(self.idle_timeout / 4, 0.2), 5.0))
            try:
                self.expire_idle()
            except Exception:
                logger.exception("expiring sessions failed")
