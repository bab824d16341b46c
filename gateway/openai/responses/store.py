"""The Responses API's stored responses (store: true), in this process's memory: what GET, DELETE and cancel read,
and the conversation that a follow-up's previous_response_id continues.

Kept under limits like the sessions' (config.Limits): at most MAX_STORED_RESPONSES records and
MAX_STORED_RESPONSE_BYTES (each measured as its JSON: the response object and its conversation), and each forgotten
after STORED_RESPONSE_IDLE_TIMEOUT seconds unused. A full store forgets rather than refuses, as a cache does, and
what it forgets is the least recently used record of the client that holds the most (by count when there are too
many, by bytes when they are too big): each client's share is what the others leave it, so one client storing
without end evicts only its own records, never everyone's. A client is its API key, or its address without keys
(access.client_id). gunicorn runs one worker process, so this memory is the whole truth.

Who may read a stored response: when the gateway has API keys, only the key that created it (another key gets the
same 404 as an unknown id); without keys a caller is only its address, which proves nothing, so the id (random,
unguessable) is what grants access, as it does for inference sessions.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from gateway.engine.sessions import visible_to
from gateway.errors import NotFound


@dataclass(eq=False)
class StoredResponse:
    id: str
    owner: str  # access.client_id() of its creator
    body: dict  # the response object as last reported: replaced whole at each change, never mutated
    conversation: list[dict] = field(default_factory=list)  # chat messages up to its reply: what a follow-up continues
    cancel: threading.Event = field(default_factory=threading.Event)  # set by POST .../cancel
    finished: threading.Event = field(default_factory=threading.Event)  # its generation ended (only then may it expire)
    last_used: float = 0.0
    size: int = 0  # bytes, as the store last measured it (json_size)


def json_size(record: StoredResponse) -> int:
    """What a record weighs: its response object and conversation as JSON (what a reader gets, near enough)."""
    return len(json.dumps([record.body, record.conversation], ensure_ascii=False, default=str))


class ResponseStore:
    def __init__(self, capacity: int, idle_timeout: float, max_bytes: int = 64 << 20,
                 clock: Callable[[], float] = time.monotonic):
        self.capacity, self.max_bytes, self.idle_timeout, self._clock = capacity, max_bytes, idle_timeout, clock
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self._count: Counter[str] = Counter()  # per client
        self._bytes: Counter[str] = Counter()  # per client
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    @property
    def bytes(self) -> int:
        return self._bytes.total()

    def add(self, record: StoredResponse) -> None:
        with self._lock:
            self._forget_idle()
            record.last_used = self._clock()
            self._records[record.id] = record
            self._count[record.owner] += 1
            self._measure(record)

    def get(self, response_id: str, client: str) -> StoredResponse:
        """The stored response, if `client` may see it; NotFound otherwise."""
        with self._lock:
            self._forget_idle()
            record = self._records.get(response_id)
            if record is None or not visible_to(record.owner, client):
                raise NotFound(f"no stored response {response_id!r} (deleted, expired, stored with store: false, "
                               "or never created)", field="response_id")
            record.last_used = self._clock()
            self._records.move_to_end(response_id)
            return record

    def remove(self, response_id: str, client: str) -> StoredResponse:
        record = self.get(response_id, client)
        with self._lock:
            self._drop(record)
        record.cancel.set()  # a deleted response that is still generating stops
        return record

    def finish(self, record: StoredResponse) -> None:
        """Its generation ended: from now on it may expire; its full reply is weighed again."""
        with self._lock:
            record.last_used = self._clock()
            record.finished.set()
            if self._records.get(record.id) is record:
                self._measure(record)

    def _measure(self, record: StoredResponse) -> None:
        """Weigh a stored record again, then forget records until the store is within its caps (lock held)."""
        size = json_size(record)
        self._bytes[record.owner] += size - record.size
        record.size = size
        while len(self._records) > self.capacity:
            self._drop(self._oldest_of(max(self._count, key=self._count.__getitem__)))
        while self._records and self.bytes > self.max_bytes:
            self._drop(self._oldest_of(max(self._bytes, key=self._bytes.__getitem__)))

    def _oldest_of(self, owner: str) -> StoredResponse:
        return next(record for record in self._records.values() if record.owner == owner)

    def _drop(self, record: StoredResponse) -> None:
        if self._records.pop(record.id, None) is None:
            return
        for held, amount in ((self._count, 1), (self._bytes, record.size)):
            held[record.owner] -= amount
            if held[record.owner] <= 0:
                del held[record.owner]

    def _forget_idle(self) -> None:
        """Drop the finished records unused for longer than the idle timeout (the caller holds the lock)."""
        now = self._clock()
        for record in [record for record in self._records.values()
                       if record.finished.is_set() and now - record.last_used > self.idle_timeout]:
            self._drop(record)
