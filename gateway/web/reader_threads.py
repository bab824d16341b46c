"""Long-lived threads for simple-websocket's per-connection readers (flask-sock's SOCK_SERVER_OPTIONS thread_class).

simple-websocket reads each connection in a thread of its own, started with the connection and ended with it.
Starting and ending a thread both take one process-wide lock of `threading` (with the GIL handed over at each
step), so when a thousand clients leave at once, a thousand ending threads queue on that lock for tens of seconds,
and everything else that starts a thread, or asks which threads exist, waits behind them: /health and /metrics
stalled for over 30 s. Here a reader runs on a thread that outlives its connection and serves the next one, so
connections coming and going start and end no threads once the pool has grown to the busiest moment's size.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

logger = logging.getLogger(__name__)


class ReaderPool:
    """Daemon threads that each run one reader at a time, and wait for the next; grown when none is free."""

    def __init__(self, name: str = "websocket-reader"):
        self.name = name
        self._readers: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0  # threads waiting for a reader; each reader handed over either takes one or adds a thread
        self._lock = threading.Lock()
        self.threads = 0

    @property
    def idle(self) -> int:
        return self._idle

    def run(self, reader: Callable[[], None]) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                self.threads += 1
                threading.Thread(target=self._serve, name=f"{self.name}-{self.threads}", daemon=True).start()
        self._readers.put(reader)

    def _serve(self) -> None:
        while True:
            reader = self._readers.get()
            try:
                reader()
            except Exception:  # the thread goes on serving others; simple-websocket handles the errors it knows
                logger.exception("a WebSocket reader failed")
            with self._lock:
                self._idle += 1


POOL = ReaderPool()


class PooledThread:
    """What simple-websocket asks of its thread_class (a target, a name, start and join), run on POOL."""

    def __init__(self, target: Callable[[], None]):
        self.name = f"{POOL.name}(_thread)"
        self._target = target
        self._finished = threading.Event()

    def start(self) -> None:
        POOL.run(self._run)

    def _run(self) -> None:
        try:
            self._target()
        finally:
            self._finished.set()

    def join(self, timeout: float | None = None) -> None:
        self._finished.wait(timeout)

    def is_alive(self) -> bool:
        return not self._finished.is_set()
