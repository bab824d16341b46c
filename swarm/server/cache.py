"""A block server's attention cache: one pool of fixed-size pages per span, and the budget that sessions
take pages from.

The budget is counted in token slots (one slot holds one position of one sequence across every block of a
session's range), so operators size it without knowing the model's head layout. A session takes slots as it
grows, a page (PAGE_TOKENS positions) at a time, never its whole max_length up front; a session that needs
slots when none are free waits a bounded time for others to close, then is refused with CacheFullError,
which the client routes around.

The pool (KVPool) holds every layer's keys and values of every session in one tensor per kind, in pages of
PAGE_TOKENS slots; each sequence of a session has a page table (SessionCache.tables). Nothing is ever
copied as a session grows: it gets another page, and attention gathers its keys through the table
(swarm/server/attention.py). Two more pages: one that stays zero (padding keys point at it) and one
that padding sequences of a captured CUDA graph write to (swarm/server/graphs.py).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Optional

import torch

from swarm.protocol import PAGE_TOKENS, CacheFullError, ServerUnavailableError


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


class KVPool:
    """Keys and values of every layer of a span, for `tokens` slots: (layers, slots, kv_heads, head_dim) each,
    in pages of PAGE_TOKENS slots, handed out and taken back on the server's event loop, never on the compute
    thread: the scheduler sees every page a round will write before the round starts (see SessionCache.fit)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, tokens: int, dtype, device):
        pages = max(tokens // PAGE_TOKENS, 1)
        shape = (layers, (pages + 2) * PAGE_TOKENS, kv_heads, head_dim)  # + the zero page and a scratch page
        self.keys = torch.empty(shape, dtype=dtype, device=device)  # untouched pages cost no memory on a CPU
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.zero_page = pages
        self.zero_slot = pages * PAGE_TOKENS
        self.scratch_slot = (pages + 1) * PAGE_TOKENS  # where padding sequences of a captured round write
        for tensor in (self.keys, self.values):
            tensor[:, self.zero_slot : self.scratch_slot].zero_()  # padding reads it: finite (0 x NaN is NaN)
        self._free = list(range(pages - 1, -1, -1))  # popped from the end: low pages first
        self._free_lock = threading.Lock()  # a caller on another thread must never get a page handed out twice

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s keys and values, (slots, kv_heads, head_dim) each."""
        return self.keys[index], self.values[index]

    def page_table(self, tables: list[list[int]], pages: int) -> torch.Tensor:
        """(sequences, pages): each table's first `pages` pages, padded with the zero page."""
        return torch.tensor([table[:pages] + [self.zero_page] * (pages - len(table)) for table in tables])

    def take_page(self) -> int:
        with self._free_lock:
            if not self._free:  # the budget keeps this from happening; a bug must not corrupt another session
                raise CacheFullError("the server's cache pool has no free page")
            page = self._free.pop()
        # attention reads whole pages, masking the positions past a sequence's length: those must hold finite
        # values (a masked 0 x NaN is still NaN), and memory never written may hold anything
        for tensor in (self.keys, self.values):
            tensor[:, page * PAGE_TOKENS : (page + 1) * PAGE_TOKENS].zero_()
        return page

    def give_back(self, pages: list[int]) -> None:
        with self._free_lock:
            self._free.extend(pages)

    def slot_map(self, tables: list[list[int]], positions: int) -> torch.Tensor:
        """(sequences, positions): the pool slot of each position 0..positions-1 of each page table (past a
        table's end: the zero page)."""
        padded = self.page_table(tables, pages_for(positions))
        offsets = torch.arange(positions)
        return padded[:, offsets // PAGE_TOKENS] * PAGE_TOKENS + offsets % PAGE_TOKENS


class SessionCache:
    """A session's pages of the pool: one page table per sequence (row). `reserved` positions per row are
    paid for in the budget; `fit` takes the pages that cover them, on the event loop, before the step that
    needs them is submitted: a round only ever writes pages its sessions already hold. Once released, a
    cache takes no page again (a closed session's late step must not take pages nobody gives back)."""

    def __init__(self, pool: KVPool, rows: int):
        self.pool, self.rows = pool, rows
        self.tables: list[list[int]] = [[] for _ in range(rows)]
        self.reserved = 0  # positions per row
        self.released = False

    @property
    def tokens(self) -> int:
        """Budget slots this session holds."""
        return self.reserved * self.rows

    def fit(self, positions: Optional[int] = None) -> None:
        """Pages for `positions` positions of every row (default: the reserved ones)."""
        if self.released:
            raise ServerUnavailableError("this session's cache was given back: the session has ended")
        needed = pages_for(self.reserved if positions is None else positions)
        for table in self.tables:
            while len(table) < needed:
                table.append(self.pool.take_page())

    def covers(self, positions: int) -> bool:
        """Whether every row holds the pages of positions 0..positions-1 (what a round writes and reads)."""
        return not self.released and all(len(table) >= pages_for(positions) for table in self.tables)

    def read(self, layer: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..positions-1 of every row in pool layer `layer`, each
        (rows, positions, kv_heads, head_dim): what attention sees of this session."""
        slots = self.pool.slot_map(self.tables, positions)
        keys, values = self.pool.layer(layer)
        return keys[slots], values[slots]

    def release(self) -> None:
        """Give every page back to the pool; only once no round can write them any more (see ServerSession)."""
        for table in self.tables:
            self.pool.give_back(table)
        self.tables = [[] for _ in range(self.rows)]
        self.released = True
