"""Inference sessions that outlive the gateway's process: each open session's token ids and the settings that
continue it (max_length, owner, expiry, where the last reply began, a dialect's state such as the WebSocket chat's
transcript) kept in an SQLite file (SESSION_STORE), so that after a restart a request naming an old session id
goes on exactly where it stopped: a fresh chain of servers is opened and the stored tokens replayed into its caches
(reopen_session).

A session's lists (its token ids, and lists in a dialect's state such as the chat transcript) are kept as parts,
rows of consecutive items: a save writes only what changed since this process's last save of the session (the new
items of a turn, or from a rewound part on), merged with the last parts while they are small beside it (up to a
bound), so that a turn costs about its own size however long the conversation, and a list loads from a few rows.

Every save is one transaction (WAL, synchronous=FULL): a process killed mid-write leaves the last committed state.
One connection serves the whole process behind a lock (gunicorn's thousands of threads would otherwise hold three
files each); other processes on the same file wait on SQLite's own locks (a busy timeout).

A row names its holder, the process that has the session open (pid and start time, so a pid reused after a
restart is not mistaken for the old process). Only a row with no live holder may be reopened, and only by one
process (claim is atomic), so a session is never open twice. A row whose holder is gone expires SESSION_IDLE_TIMEOUT
after its last use (expires_at), as an idle open session does; any process sweeps such rows.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

from gateway.engine.sequences import restore
from gateway.engine.served import GatewaySession

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 1: lists were JSON columns of the sessions row, rewritten whole by every save
MERGED_PART_BYTES = 64 * 1024  # parts merge up to this size: what a turn rewrites beyond its own, at most
BUSY_TIMEOUT_SECONDS = 10.0  # another process writing: wait this long for SQLite's lock before failing
SESSIONS_TABLE = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    owner TEXT NOT NULL,
    max_length INTEGER NOT NULL,
    pending TEXT NOT NULL,         -- JSON token ids sampled but not yet sent (the last one, or none)
    reply_start INTEGER,
    state TEXT NOT NULL,           -- JSON: what a dialect keeps to continue, but its lists (in session_parts)
    holder TEXT,                   -- the process that has it open (pid@start time); NULL: none
    last_used REAL NOT NULL,       -- Unix time
    expires_at REAL NOT NULL,      -- Unix time after which, held by no live process, it is gone
    updated_at REAL NOT NULL
)
"""
PARTS_TABLE = """
CREATE TABLE IF NOT EXISTS session_parts (
    session_id TEXT NOT NULL,
    list TEXT NOT NULL,            -- 'history' (token ids in the servers' caches), or 'state.KEY': a list in the state
    start INTEGER NOT NULL,        -- the index in the list of this part's first item
    items TEXT NOT NULL,           -- JSON list: the list's items from `start` to the next part's
    PRIMARY KEY (session_id, list, start)
)
"""
COLUMNS = ("id", "model", "owner", "max_length", "pending", "reply_start", "state", "holder", "last_used",
           "expires_at", "updated_at")
HISTORY, STATE_LIST = "history", "state."  # the parts' list names


class SessionStoreError(Exception):
    """The store cannot be used (corrupt, unreadable, from a newer version): the gateway must not start."""


@dataclass(frozen=True)
class StoredSession:
    id: str
    model: str
    owner: str
    max_length: int
    history: tuple[int, ...]
    pending: tuple[int, ...]
    reply_start: Optional[int]
    state: dict = field(default_factory=dict)
    holder: Optional[str] = None
    last_used: float = 0.0
    expires_at: float = 0.0


def this_process() -> str:
    """This process as a row's holder: its pid and start time (a pid alone is reused after a restart)."""
    return _process_token(os.getpid())


def _process_token(pid: int) -> str:
    return f"{pid}@{psutil.Process(pid).create_time():.2f}"


def holder_alive(holder: Optional[str]) -> bool:
    if not holder:
        return False
    pid = int(holder.split("@", 1)[0])
    try:
        return _process_token(pid) == holder
    except (psutil.Error, ValueError):  # gone (or never ours to see)
        return False


class SessionStore:
    """The sessions of one SQLite file, opened and checked at once (SessionStoreError if unusable)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.holder = this_process()
        self._lock = threading.Lock()
        self._written: dict[str, _Written] = {}  # session id -> what this process last wrote of it
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None,
                                       check_same_thread=False)
            self._check_and_migrate()
            logger.info("session store %s: %d stored sessions, %d of them expired and gone", self.path,
                        self.count(), self.sweep())
        except (sqlite3.Error, OSError, ValueError) as error:
            raise SessionStoreError(f"SESSION_STORE={self.path}: cannot use the session store ({error}); "
                                    "move the file away to start with no stored sessions, or set "
                                    "SESSION_STORE=off") from None

    def _check_and_migrate(self) -> None:
        db = self._db
        problems = [row[0] for row in db.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            raise sqlite3.DatabaseError(f"the file is damaged: {'; '.join(problems[:3])}")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"written by a newer gateway (schema {version}; this one reads "
                                        f"{SCHEMA_VERSION})")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # a commit is on disk before save returns
        with self._transaction():  # a file that is not this gateway's is left as it was
            db.execute(SESSIONS_TABLE)
            db.execute(PARTS_TABLE)
            if version == 1:
                _migrate_from_1(db)
            columns = [row[1] for row in db.execute("PRAGMA table_info(sessions)")]
            if tuple(columns) != COLUMNS:
                raise sqlite3.DatabaseError(f"its sessions table is not this gateway's (columns "
                                            f"{', '.join(columns)})")
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _transaction(self):
        return _Transaction(self._db, self._lock)

    # --------------------------------------------------------------------------------- writes

    def save(self, session: GatewaySession, idle_timeout: float) -> None:
        """The session as it is now, held by this process, in one transaction: its row, and of its lists only the
        parts that changed since this process last saved it."""
        now = time.time()
        last_used = now - max(time.monotonic() - session.last_used, 0.0)
        lists, rest = _split_state(session.state)
        lists[HISTORY] = session.history
        row = (session.id, session.model.name, session.owner, session.max_length, json.dumps(session.pending),
               session.reply_start, json.dumps(rest), self.holder, last_used, last_used + idle_timeout, now)
        with self._transaction():
            before, written = self._written_before(session.id), _Written(now)
            for name in {*before.lists, *lists}:
                parts = self._write_parts(session.id, name, before.lists.get(name), lists.get(name, []))
                if name in lists:
                    written.lists[name] = parts
            self._db.execute(f"INSERT OR REPLACE INTO sessions VALUES ({', '.join('?' * len(COLUMNS))})", row)
            self._written[session.id] = written  # a commit that fails leaves updated_at older: _written_before

    def _written_before(self, session_id: str) -> _Written:
        """What this process last wrote of the session, if the row is still as it left it; else its parts are
        dropped, to be written whole (its first save here, or a row another process wrote since)."""
        written = self._written.pop(session_id, None)
        row = self._db.execute("SELECT updated_at FROM sessions WHERE id = ?", (session_id,)).fetchone()
        if written is None or row is None or row[0] != written.updated_at:
            self._db.execute("DELETE FROM session_parts WHERE session_id = ?", (session_id,))
            return _Written(0.0)
        return written

    def _write_parts(self, session_id: str, name: str, before: Optional[tuple[list, list[tuple[int, int]]]],
                     items: list) -> tuple[list, list[tuple[int, int]]]:
        """One list's parts brought up to `items`: the parts that end within what is unchanged stay, the others go,
        and one new part holds the rest, merged with the last kept parts while each is at most twice its size and
        the whole stays under MERGED_PART_BYTES: small parts never pile up (a list loads from a few rows), and a turn
        writes its own size and at most one bounded merge. Returns the list's items as written (a copy) and its
        parts' (start, JSON size), for the next save."""
        items_before, parts = before or ([], [])
        unchanged = _common_length(items_before, items)
        ends = [*(start for start, _ in parts[1:]), len(items_before)]
        kept = next((index for index, end in enumerate(ends) if end > unchanged), len(parts))
        start = parts[kept][0] if kept < len(parts) else len(items_before)
        parts = parts[:kept]
        if len(items) > start:
            text = json.dumps(items[start:])
            merged, size = start, len(text)
            while parts and parts[-1][1] <= 2 * size and parts[-1][1] + size <= MERGED_PART_BYTES:
                merged, part_size = parts.pop()
                size += part_size
            if merged != start:
                start, text = merged, json.dumps(items[merged:])
        self._db.execute("DELETE FROM session_parts WHERE session_id = ? AND list = ? AND start >= ?",
                         (session_id, name, start))
        if len(items) > start:
            self._db.execute("INSERT INTO session_parts VALUES (?, ?, ?, ?)", (session_id, name, start, text))
            parts.append((start, len(text)))
        return list(items), parts

    def release(self, session_id: str, idle_timeout: float) -> None:
        """This process lets the session go but keeps it (a WebSocket gone): another may reopen it until it expires."""
        now = time.time()
        with self._transaction():
            self._written.pop(session_id, None)
            self._db.execute("UPDATE sessions SET holder = NULL, last_used = ?, expires_at = ?, updated_at = ? "
                             "WHERE id = ? AND holder = ?", (now, now + idle_timeout, now, session_id, self.holder))

    def delete(self, session_id: str) -> None:
        with self._transaction():
            self._written.pop(session_id, None)
            self._db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
            self._db.execute("DELETE FROM session_parts WHERE session_id = ?", (session_id,))

    def claim(self, session_id: str) -> Optional[StoredSession]:
        """The stored session, now held by this process; None if there is none, it expired, or a live process
        holds it (each caller learns which from `load` first)."""
        with self._transaction():  # no other process can claim it between the read and the write
            stored = self._load(session_id)
            if stored is None or not self._claimable(stored):
                return None
            self._db.execute("UPDATE sessions SET holder = ? WHERE id = ?", (self.holder, session_id))
        return stored

    def sweep(self) -> int:
        """Delete the expired rows that no live process holds; return how many."""
        with self._lock:
            rows = self._db.execute("SELECT id, holder FROM sessions WHERE expires_at < ?", (time.time(),)).fetchall()
        gone = [(session_id, holder) for session_id, holder in rows
                if holder != self.holder and not holder_alive(holder)]
        if not gone:
            return 0
        with self._transaction():  # unless another process claimed one meanwhile
            self._db.executemany("DELETE FROM sessions WHERE id = ? AND holder IS ? AND expires_at < ?",
                                 [(session_id, holder, time.time()) for session_id, holder in gone])
            self._db.execute("DELETE FROM session_parts WHERE session_id NOT IN (SELECT id FROM sessions)")
        return len(gone)

    # --------------------------------------------------------------------------------- reads

    def load(self, session_id: str) -> Optional[StoredSession]:
        with self._lock:
            return self._load(session_id)

    def _load(self, session_id: str) -> Optional[StoredSession]:
        row = self._db.execute(f"SELECT {', '.join(COLUMNS)} FROM sessions WHERE id = ?", (session_id,)).fetchone()
        if row is None:
            return None
        values, lists = dict(zip(COLUMNS, row)), {}
        for name, items in self._db.execute("SELECT list, items FROM session_parts WHERE session_id = ? "
                                            "ORDER BY list, start", (session_id,)):
            lists.setdefault(name, []).extend(json.loads(items))
        state = json.loads(values["state"])
        state.update({name[len(STATE_LIST):]: items for name, items in lists.items() if name.startswith(STATE_LIST)})
        return StoredSession(values["id"], values["model"], values["owner"], values["max_length"],
                             tuple(lists.get(HISTORY, ())), tuple(json.loads(values["pending"])),
                             values["reply_start"], state, values["holder"], values["last_used"],
                             values["expires_at"])

    def held_elsewhere(self, stored: StoredSession) -> bool:
        """Whether another live process (a second gunicorn worker) has the session open."""
        return stored.holder not in (None, self.holder) and holder_alive(stored.holder)

    def _claimable(self, stored: StoredSession) -> bool:
        return not self.held_elsewhere(stored) and (stored.expires_at >= time.time() or stored.holder == self.holder)

    def count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


@dataclass
class _Written:
    """What this process last wrote of one session: its row's updated_at, and each list's items and its parts'
    starts and sizes (see SessionStore._write_parts). The items are compared by value with the next save's, never
    re-encoded: token ids, and a dialect's entries, which it builds afresh for each save (model_dump)."""

    updated_at: float
    lists: dict[str, tuple[list, list[tuple[int, int]]]] = field(default_factory=dict)


def _split_state(state: dict) -> tuple[dict[str, list], dict]:
    """A dialect's state as the lists kept in parts (by part name) and the rest, kept in the session's row (empty
    lists too: a list with no parts would not come back)."""
    lists = {STATE_LIST + key: value for key, value in state.items() if isinstance(value, list) and value}
    return lists, {key: value for key, value in state.items() if STATE_LIST + key not in lists}


def _common_length(before: list, now: list) -> int:
    """How many leading items the two lists share (compared at C speed: an entry that is the same object is equal
    without a look inside)."""
    if now[:len(before)] == before:  # the common case, at C speed: the list only grew
        return len(before)
    return next((index for index, (old, new) in enumerate(zip(before, now)) if old != new), min(len(before), len(now)))


def _migrate_from_1(db: sqlite3.Connection) -> None:
    """Schema 1 kept the lists in the sessions row (a history column, and the state's lists in its JSON): each of
    them becomes one part."""
    for session_id, history, state in db.execute("SELECT id, history, state FROM sessions").fetchall():
        lists, rest = _split_state(json.loads(state))
        lists[HISTORY] = json.loads(history)
        db.executemany("INSERT INTO session_parts VALUES (?, ?, 0, ?)",
                       [(session_id, name, json.dumps(items)) for name, items in lists.items() if items])
        db.execute("UPDATE sessions SET state = ? WHERE id = ?", (json.dumps(rest), session_id))
    db.execute("ALTER TABLE sessions DROP COLUMN history")


class _Transaction:
    """One write transaction on the shared connection, under the process's lock: committed at the end of the block,
    rolled back if it raises. It takes SQLite's write lock at once (IMMEDIATE), waiting out other processes' writes
    (the busy timeout): a deferred one that read first could only fail, at once, once another process had written."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock):
        self.db, self.lock = db, lock

    def __enter__(self):
        self.lock.acquire()
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise

    def __exit__(self, kind, error, traceback):
        try:
            self.db.execute("ROLLBACK" if kind else "COMMIT")
        finally:
            self.lock.release()


def open_store(setting: Optional[str]) -> Optional[SessionStore]:
    """The store SESSION_STORE names (a path), or None when it is off: sessions then live in memory only."""
    return SessionStore(Path(setting).expanduser()) if setting else None


def reopen_session(engine, stored: StoredSession) -> GatewaySession:
    """A stored session opened again on a fresh chain of servers: its history replayed into their caches in one
    step, the pending token kept for the next generation's first step, exactly as it was. It expires when idle, as
    an HTTP session does, unless a WebSocket takes it up (it then lives with that connection)."""
    model = engine.model(stored.model)
    session = GatewaySession(model, model.remote.session(stored.max_length), stored.max_length, True,
                             stored.owner, id=stored.id, reply_start=stored.reply_start, state=dict(stored.state),
                             stored=True)
    try:
        if stored.history:
            engine.prefill(session, list(stored.history))  # through the engine loop, like every step
        restore(session, stored.history, stored.pending)
    except BaseException:
        session.close()
        raise
    logger.info("reopened inference session %s from the store: %d tokens replayed", stored.id, len(stored.history))
    return session
