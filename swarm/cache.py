"""A block server's attention-cache budget, counted in token slots (one slot holds one position of one
sequence across every block of the span), so operators size it without knowing the model's head layout."""

from __future__ import annotations

import threading

from swarm.protocol import CacheFullError


class CacheBudget:
    def __init__(self, total_tokens: int):
        self.total = total_tokens
        self._used = 0
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        return self.total - self._used

    def reserve(self, tokens: int) -> None:
        with self._lock:
            if tokens > self.total - self._used:
                raise CacheFullError(
                    f"server cache is full: {tokens} tokens requested, {self.total - self._used} of "
                    f"{self.total} free; try another server or a shorter max_length"
                )
            self._used += tokens

    def release(self, tokens: int) -> None:
        with self._lock:
            self._used -= tokens
