"""The Responses API's stored responses (store: true), in this process's memory: what GET, DELETE and cancel read,
and the conversation that a follow-up's previous_response_id continues.

Kept under limits like the sessions' (config.Limits): at most MAX_STORED_RESPONSES (the least recently used is
forgotten first, as a cache forgets: a full store must not refuse new replies) and each forgotten after
STORED_RESPONSE_IDLE_TIMEOUT seconds unused. gunicorn runs one worker process, so this memory is the whole truth.

Who may read a stored response: when the gateway has API keys, only the key that created it (another key gets the
same 404 as an unknown id); without keys a caller is only its address, which proves nothing, so the id (random,
unguessable) is what grants access, as it does for inference sessions.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

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


class ResponseStore:
    def __init__(self, capacity: int, idle_timeout: float, clock: Callable[[], float] = time.monotonic):
        self.capacity, self.idle_timeout, self._clock = capacity, idle_timeout, clock
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: StoredResponse) -> None:
        with self._lock:
            self._forget_idle()
            record.last_used = self._clock()
            self._records[record.id] = record
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)

    def get(self, response_id: str, client: str) -> StoredResponse:
        """The stored response, if `client` may see it; NotFound otherwise."""
        with self._lock:
            self._forget_idle()
            record = self._records.get(response_id)
            if record is None or not _visible(record, client):
                raise NotFound(f"no stored response {response_id!r} (deleted, expired, stored with store: false, "
                               "or never created)", field="response_id")
            record.last_used = self._clock()
            self._records.move_to_end(response_id)
            return record

    def remove(self, response_id: str, client: str) -> StoredResponse:
        record = self.get(response_id, client)
        with self._lock:
            self._records.pop(response_id, None)
        record.cancel.set()  # a deleted response that is still generating stops
        return record

    def finish(self, record: StoredResponse) -> None:
        """Its generation ended: from now on it may expire."""
        with self._lock:
            record.last_used = self._clock()
            record.finished.set()

    def _forget_idle(self) -> None:
        """Drop the finished records unused for longer than the idle timeout (the caller holds the lock)."""
        now = self._clock()
        for response_id in [response_id for response_id, record in self._records.items()
                            if record.finished.is_set() and now - record.last_used > self.idle_timeout]:
            del self._records[response_id]


def _visible(record: StoredResponse, client: str) -> bool:
    """Keys identify callers, addresses do not (see the module docstring)."""
    return not record.owner.startswith("key:") or record.owner == client
