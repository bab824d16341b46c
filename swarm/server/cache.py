"""A block server's attention cache: per-session key/value buffers that grow page by page, under a budget.

The budget is counted in token slots (one slot holds one position of one sequence across every block of a
session's range), so operators size it without knowing the model's head layout. A session takes slots as it
grows, a page (PAGE_TOKENS positions) at a time, never its whole max_length up front; a session that needs
slots when none are free waits a bounded time for others to close, then is refused with CacheFullError,
which the client routes around.

Each layer's keys and values stay contiguous, so attention reads them with one scaled_dot_product_attention
call and each step writes only its new positions in place. Growing by a page moves the cache once into a
bigger buffer: every PAGE_TOKENS positions, never per token.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Optional

import torch

from swarm.protocol import PAGE_TOKENS, CacheFullError


def pages_for(positions: int) -> int:
    return math.ceil(positions / PAGE_TOKENS)


class CacheBudget:
    """Token slots, taken and given back on the server's event loop; takers may wait for a bounded time."""

    def __init__(self, total_tokens: int):
        self.total = total_tokens
        self.used = 0
        self._released: Optional[asyncio.Event] = None  # set (and replaced) whenever slots come back

    @property
    def free(self) -> int:
        return self.total - self.used

    async def take(self, tokens: int, wait: float) -> None:
        """Take `tokens` slots, waiting up to `wait` seconds for other sessions to free enough of them."""
        if tokens > self.total:
            raise CacheFullError(f"{tokens} cache tokens requested, more than this server's whole cache ({self.total})")
        deadline = time.monotonic() + wait
        while tokens > self.free:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CacheFullError(
                    f"server cache is full: {tokens} tokens requested, {self.free} of {self.total} free "
                    f"after waiting {wait:g} s; try another server"
                )
            if self._released is None:
                self._released = asyncio.Event()
            try:
                await asyncio.wait_for(self._released.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        self.used += tokens

    def give_back(self, tokens: int) -> None:
        self.used -= tokens
        if self._released is not None:
            self._released.set()
            self._released = None


class LayerCache:
    """One layer's keys and values of one session: (rows, kv_heads, capacity, head_dim), written in place."""

    def __init__(self, rows: int, kv_heads: int, head_dim: int, dtype, device):
        self.keys = torch.empty((rows, kv_heads, 0, head_dim), dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def grow(self, capacity: int, kept: int) -> None:
        """Move the first `kept` positions into buffers of `capacity` positions."""
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], capacity, old.shape[3]))
            new[:, :, :kept] = old[:, :, :kept]
            setattr(self, name, new)

    def write(self, position: int, keys: torch.Tensor, values: torch.Tensor):
        """Store the new positions' keys/values; return views over everything cached so far."""
        end = position + keys.shape[2]
        self.keys[:, :, position:end] = keys
        self.values[:, :, position:end] = values
        return self.keys[:, :, :end], self.values[:, :, :end]


class SessionCache:
    """A session's caches for each block of its range. `reserved` positions are paid for in the budget;
    the buffers catch up (`fit`) on the compute thread, right before a step that needs them."""

    def __init__(self, layers: list[LayerCache], rows: int):
        self.layers, self.rows = layers, rows
        self.reserved = 0  # positions per row

    @property
    def tokens(self) -> int:
        """Budget slots this session holds."""
        return self.reserved * self.rows

    def fit(self, kept: int) -> None:
        if self.layers and self.layers[0].capacity < self.reserved:
            for layer in self.layers:
                layer.grow(self.reserved, kept)

    def __getitem__(self, index: int) -> LayerCache:
        return self.layers[index]
