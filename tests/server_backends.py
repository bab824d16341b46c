"""What the block server's unit tests share: a Backend over a tiny span, run through one scenario on an event loop
of its own (tests/unit/test_forks.py, test_page_pool_races.py, test_server_cache_share.py, test_warm_sessions.py)."""

from __future__ import annotations

import asyncio
import secrets
from typing import Awaitable, Callable

from swarm.protocol import PAGE_TOKENS
from swarm.server.backend import Backend
from swarm.server.cache import CacheBudget


def run_scenario(span, scenario: Callable[[Backend], Awaitable[None]], limits, pool_pages: int,
                 settle: bool = True, rounds_by_hand: bool = False,
                 check: Callable[[Backend], None] = lambda backend: None) -> None:
    """`scenario(backend)` on a Backend of `pool_pages` pages. `settle`: then every session is closed, `check`ed,
    and every page and slot must be back (the budget empty, no peer counted, the pool whole, nothing shared).
    `rounds_by_hand`: the scheduler's thread picks no round: the scenario runs them."""
    async def body():
        backend = Backend(span, CacheBudget(pool_pages * PAGE_TOKENS), limits)
        if rounds_by_hand:
            backend.scheduler.stop()
        try:
            await scenario(backend)
            if settle:
                for session in list(backend.sessions):
                    session.close()
                check(backend)
                assert backend.budget.used == 0 and not backend.cache_by_peer and not backend.sessions.per_peer
                assert span.pool.free_pages == pool_pages and span.pool.shared_pages == 0
        finally:
            backend.close()

    asyncio.run(body())


async def opened_sessions(backend: Backend, count: int, blocks: int, max_length: int = 64) -> list:
    """`count` sessions of blocks 0..`blocks` opened on `backend` by one peer ("peer"), each of one row."""
    return [await backend.open_session({"start": 0, "end": blocks, "max_length": max_length, "batch_size": 1,
                                        "session_id": secrets.token_hex(16)}, "peer") for _ in range(count)]
