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

Pages are counted (copy-on-write): a session forked from another at length L (SessionCache.fork) holds the
pages of positions [0, L) of the source's tables instead of copies. A shared page is never written: before a
step writes positions [p, end), SessionCache.prepare replaces each shared page covering them by a private copy
(on the event loop, like every page taken). The budget counts physical pages: a page's slots come back when
its last holder lets go (release returns how many pages that freed).

The pool also keeps, as pages are taken, shared, given back and parked, how many pages only parked sessions
hold (what evicting every parked session would free, see swarm/server/warm.py) and how many are shared: each
count changes by one page at a time, so parking a session costs its own pages, and reading a count nothing.
"""

from __future__ import annotations

import array
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

    def take_now(self, tokens: int) -> bool:
        """Take `tokens` slots if they are free now; whether it did."""
        if tokens > self.free:
            return False
        self.used += tokens
        return True

    def give_back(self, tokens: int) -> None:
        self.used -= tokens
        if self._released is not None:
            self._released.set()
            self._released = None


class KVPool:
    """Keys and values of every layer of a span, for `tokens` slots: (layers, slots, kv_heads, head_dim) each,
    in pages of PAGE_TOKENS slots, handed out and taken back on the server's event loop, never on the compute
    thread: the scheduler sees every page a round will write before the round starts (see SessionCache.prepare)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, tokens: int, dtype, device):
        self.pages = pages = max(tokens // PAGE_TOKENS, 1)
        shape = (layers, (pages + 2) * PAGE_TOKENS, kv_heads, head_dim)  # + the zero page and a scratch page
        self.keys = torch.empty(shape, dtype=dtype, device=device)  # untouched pages cost no memory on a CPU
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.zero_page = pages
        self.zero_slot = pages * PAGE_TOKENS
        self.scratch_slot = (pages + 1) * PAGE_TOKENS  # where padding sequences of a captured round write
        for tensor in (self.keys, self.values):
            tensor[:, self.zero_slot : self.scratch_slot].zero_()  # padding reads it: finite (0 x NaN is NaN)
        self._free = list(range(pages - 1, -1, -1))  # popped from the end: low pages first
        self._holders = [0] * pages  # how many page tables hold each page (0: free)
        self._parked = [0] * pages  # how many of them are parked sessions' (SessionCache.set_parked)
        self.shared_pages = 0  # pages that more than one page table holds
        self.parked_only_pages = 0  # pages that only parked sessions' tables hold: evicting them frees these
        self._free_lock = threading.Lock()  # a caller on another thread must never get a page handed out twice
        # each layer's keys and values as slots (slots, kv_heads, head_dim) and as pages (pages, PAGE_TOKENS,
        # kv_heads, head_dim): views made once, not per layer of every round
        self._layers = [(self.keys[index], self.values[index]) for index in range(layers)]
        self._paged = [tuple(tensor.unflatten(0, (-1, PAGE_TOKENS)) for tensor in pair) for pair in self._layers]

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def holders(self, page: int) -> int:
        return self._holders[page]

    def parked_only(self, page: int) -> bool:
        """Whether only parked sessions hold `page` (evicting them would free it)."""
        return 0 < self._holders[page] == self._parked[page]

    def _hold(self, page: int, holders: int, parked: int) -> None:
        """`holders` more holders of `page`, `parked` of them parked (either may be negative), and the counts
        kept; under the lock."""
        was_shared, was_parked_only = self._holders[page] > 1, self.parked_only(page)
        self._holders[page] += holders
        self._parked[page] += parked
        self.shared_pages += (self._holders[page] > 1) - was_shared
        self.parked_only_pages += self.parked_only(page) - was_parked_only

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s keys and values, (slots, kv_heads, head_dim) each."""
        return self._layers[index]

    def paged_layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s keys and values by page, (pages, PAGE_TOKENS, kv_heads, head_dim) each."""
        return self._paged[index]

    def page_table(self, tables: list[list[int]], pages: int) -> torch.Tensor:
        """(sequences, pages): each table's first `pages` pages, padded with the zero page. Built in an int64
        array and viewed as a tensor: torch.tensor of nested lists takes ~90 ns an element (150 us for 48
        sessions' tables, the largest part of a decode round's packing), this a third of it."""
        flat = array.array("q")
        for table in tables:
            flat.extend(table[:pages])
            flat.extend([self.zero_page] * (pages - len(table)))
        return torch.frombuffer(flat, dtype=torch.int64).view(len(tables), pages) if flat else \
            torch.empty(len(tables), pages, dtype=torch.int64)

    def take_page(self) -> int:
        """A free page, for one holder (one in use: see SessionCache.prepare)."""
        with self._free_lock:
            if not self._free:  # the budget keeps this from happening; a bug must not corrupt another session
                raise CacheFullError("the server's cache pool has no free page")
            page = self._free.pop()
            self._hold(page, 1, 0)
        # attention reads whole pages, masking the positions past a sequence's length: those must hold finite
        # values (a masked 0 x NaN is still NaN), and memory never written may hold anything
        for tensor in (self.keys, self.values):
            tensor[:, page * PAGE_TOKENS : (page + 1) * PAGE_TOKENS].zero_()
        return page

    def copy_of(self, page: int) -> int:
        """A new page holding what `page` holds (of every layer), for a holder about to write it."""
        copy = self.take_page()
        source = slice(page * PAGE_TOKENS, (page + 1) * PAGE_TOKENS)
        target = slice(copy * PAGE_TOKENS, (copy + 1) * PAGE_TOKENS)
        for tensor in (self.keys, self.values):
            tensor[:, target] = tensor[:, source]
        return copy

    def share(self, pages: list[int], parked: bool = False) -> None:
        """One more holder (a parked one, if `parked`) for each of these pages (held already)."""
        with self._free_lock:
            for page in pages:
                if self._holders[page] < 1:
                    raise RuntimeError(f"page {page} is free: it cannot be shared")
                self._hold(page, 1, 0)

    def give_back(self, pages: list[int], parked: bool = False) -> int:
        """One holder less (a parked one, if `parked`) for each of these pages; those nobody holds any more are
        free again. Returns how many."""
        freed = 0
        with self._free_lock:
            for page in pages:
                self._hold(page, -1, -parked)
                if self._holders[page] == 0:
                    self._free.append(page)
                    freed += 1
        return freed

    def park(self, pages: list[int], parked: bool) -> None:
        """A holder of these pages was parked (`parked`), or is no longer."""
        with self._free_lock:
            for page in pages:
                self._hold(page, 0, 1 if parked else -1)

    def slot_map(self, tables: list[list[int]], positions: int) -> torch.Tensor:
        """(sequences, positions): the pool slot of each position 0..positions-1 of each page table (past a
        table's end: the zero page)."""
        padded = self.page_table(tables, pages_for(positions))
        offsets = torch.arange(positions)
        return padded[:, offsets // PAGE_TOKENS] * PAGE_TOKENS + offsets % PAGE_TOKENS


class SessionCache:
    """A session's pages of the pool: one page table per sequence (row). `prepare` takes the pages a step
    writes (new ones, and private copies of shared ones), on the event loop, before the step is submitted: a
    round only ever writes pages its sessions already hold, and hold alone. Once released, a cache takes no
    page again (a closed session's late step must not take pages nobody gives back)."""

    def __init__(self, pool: KVPool, rows: int):
        self.pool, self.rows = pool, rows
        self.tables: list[list[int]] = [[] for _ in range(rows)]
        self.released = False
        self.parked = False  # its session is parked: the pool counts its pages as a parked holder's

    def set_parked(self, parked: bool) -> None:
        """Its session was parked, or is no longer: the pool's counts of parked pages follow (its pages only)."""
        if parked != self.parked:
            self.parked = parked
            for table in self.tables:
                self.pool.park(table, parked)

    def holds_parked_only(self) -> bool:
        """Whether it holds a page that only parked sessions hold: evicting them all would free something."""
        return any(self.pool.parked_only(page) for table in self.tables for page in table)

    @property
    def pages(self) -> int:
        """Pages this cache's tables hold (shared ones included)."""
        return sum(len(table) for table in self.tables)

    @property
    def private_pages(self) -> int:
        """Pages only this cache holds: what releasing it would free now."""
        return sum(1 for table in self.tables for page in table if self.pool.holders(page) == 1)

    def pages_needed(self, start: int, end: int) -> int:
        """Pages a write of positions [start, end) of every row would take: new ones past the tables' end, and
        a copy of each shared page covering them."""
        first, last = start // PAGE_TOKENS, pages_for(end)
        needed = 0
        for table in self.tables:
            needed += max(last - len(table), 0)
            needed += sum(1 for page in table[first:last] if self.pool.holders(page) > 1)
        return needed

    def prepare(self, start: int, end: int) -> int:
        """Make positions [start, end) of every row writable by this cache alone: pages for them, shared ones
        replaced by private copies. Returns how many pages it took."""
        if self.released:
            raise ServerUnavailableError("this session's cache was given back: the session has ended")
        parked = self.parked  # (a push may start a parked session's step) counted as a holder in use's meanwhile
        self.set_parked(False)
        try:
            return self._prepare(start, end)
        finally:
            self.set_parked(parked)

    def _prepare(self, start: int, end: int) -> int:
        first, last = start // PAGE_TOKENS, pages_for(end)
        taken = 0
        for table in self.tables:
            for index in range(first, min(last, len(table))):
                if self.pool.holders(table[index]) > 1:
                    shared, table[index] = table[index], self.pool.copy_of(table[index])
                    self.pool.give_back([shared])  # another holder keeps it
                    taken += 1
            while len(table) < last:
                table.append(self.pool.take_page())
                taken += 1
        return taken

    def fork(self, length: int) -> "SessionCache":
        """A cache holding this one's pages of positions [0, length), shared (copy-on-write)."""
        if self.released:
            raise ServerUnavailableError("this session's cache was given back: the session has ended")
        forked = SessionCache(self.pool, self.rows)
        forked.tables = [table[: pages_for(length)] for table in self.tables]
        for table in forked.tables:
            self.pool.share(table)
        return forked

    def truncate(self, positions: int) -> int:
        """Let go of the pages past positions 0..positions-1 (a rewind: rejected draft tokens, a regenerate).
        Returns how many that freed (shared ones stay with their other holders)."""
        keep = pages_for(positions)
        freed = sum(self.pool.give_back(table[keep:], self.parked) for table in self.tables)
        self.tables = [table[:keep] for table in self.tables]
        return freed

    def covers(self, positions: int) -> bool:
        """Whether every row holds the pages of positions 0..positions-1 (what a round writes and reads)."""
        return not self.released and all(len(table) >= pages_for(positions) for table in self.tables)

    def read(self, layer: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..positions-1 of every row in pool layer `layer`, each
        (rows, positions, kv_heads, head_dim): what attention sees of this session."""
        slots = self.pool.slot_map(self.tables, positions)
        keys, values = self.pool.layer(layer)
        return keys[slots], values[slots]

    def release(self) -> int:
        """Let go of every page; only once no round can write them any more (see ServerSession). Returns how
        many pages that freed (shared ones stay with their other holders)."""
        freed = sum(self.pool.give_back(table, self.parked) for table in self.tables)
        self.tables = [[] for _ in range(self.rows)]
        self.released, self.parked = True, False
        return freed
