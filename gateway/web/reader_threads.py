"""Long-lived threads for simple-websocket's per-connection readers (flask-sock's SOCK_SERVER_OPTIONS thread_class).

simple-websocket reads each connection in a thread of its own, started with the connection and ended with it.
Starting and ending a thread both take one process-wide lock of `threading` (with the GIL handed over at each
step), so when a thousand clients leave at once, a thousand ending threads queue on that lock, and everything
else that starts a thread waits behind them (py-spy found /health's background lookup starting its thread there).
Here a reader runs on a thread that outlives its connection and serves the next one, so connections coming and
going start and end no threads once the pool has grown to the busiest moment's size.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Callable

logger = logging.getLogger(__name__)


class IdleTokens:
    """A count of idle threads that a thousand threads may add to at once: a token each in a C-level queue, whose put
    and take run whole under the GIL (a lock held over Python code is kept by a thread that loses the GIL there,
    while every other thread queues for it, each waiting its turn at the GIL)."""

    def __init__(self):
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._tokens.put(None)

    def __len__(self) -> int:
        return self._tokens.qsize()

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        try:
            self._tokens.get(blocking, timeout)
        except queue.Empty:
            return False
        return True


class ReaderPool:
    """Daemon threads that each run one reader at a time, and wait for the next; grown when none is free."""

    def __init__(self, name: str = "websocket-reader"):
        self.name = name
        self._readers: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = IdleTokens()  # each reader handed over either takes an idle thread's token or adds a thread
        self._started = itertools.count(1)
        self.threads = 0

    @property
    def idle(self) -> int:
        return len(self._idle)

    def run(self, reader: Callable[[], None]) -> None:
        if not self._idle.acquire(blocking=False):
            number = next(self._started)
            self.threads = max(self.threads, number)
            threading.Thread(target=self._serve, name=f"{self.name}-{number}", daemon=True).start()
        self._readers.put(reader)

    def _serve(self) -> None:
        while True:
            reader = self._readers.get()
            try:
                reader()
            except Exception:  # the thread goes on serving others; simple-websocket handles the errors it knows
                logger.exception("a WebSocket reader failed")
            self._idle.release()


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
