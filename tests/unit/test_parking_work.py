"""What parking costs a block server (swarm/server/warm.py), without the network: parking, closing and rpc_info
touch the session's own pages, never every parked session's (one peer with many parked forks of a long prefix
made every park, close and info rescan all of them: 15 ms decode steps became 323 ms, and one request that found
the cache full froze the server for 32 s); and one peer's parked sessions claim at most the whole cache, its
least recently used going first. The pool's counts of parked and shared pages are exact after any mix of
opens, forks, steps, parks and closes."""

import asyncio
import random

import pytest
import torch

from swarm.protocol import PAGE_TOKENS
from swarm.server.backend import Backend, ServerLimits
from swarm.server.span import load_span
from server_backends import run_scenario
from tiny_model import build_tiny_model

HIDDEN = 64
PREFIX_PAGES, FORKS = 32, 40  # the attack's shape (8,192 tokens, 255 forks), smaller
POOL_PAGES = (FORKS + 2) * PREFIX_PAGES  # the forks' claims fit the whole cache: none is evicted for its peer
LIMITS = ServerLimits(max_session_tokens=PREFIX_PAGES * PAGE_TOKENS, cache_wait=0.05, max_cache_share_per_peer=1.0,
                      warm_cache_share=1.0)
OPENING = {"start": 0, "end": 2, "max_length": PREFIX_PAGES * PAGE_TOKENS, "batch_size": 1}


@pytest.fixture(scope="module")
def span(tmp_path_factory):
    return load_span(build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", 2), 0, 2)


class CountedTable(list):
    """A page table that counts the entries anything reads by iterating it (the work of a scan)."""

    visits = 0

    def __iter__(self):
        for page in super().__iter__():
            CountedTable.visits += 1
            yield page


def counted(session) -> None:
    session.cache.tables = [CountedTable(table) for table in session.cache.tables]


def work(action) -> int:
    before = CountedTable.visits
    action()
    return CountedTable.visits - before


async def prefix_and_forks(backend: Backend, peer: str = "peer", pages: int = PREFIX_PAGES, forks: int = FORKS):
    """A session holding `pages` pages (taken, not computed: what they hold does not matter here), and `forks`
    forks of all of it, sharing every page."""
    length = pages * PAGE_TOKENS
    opening = {**OPENING, "max_length": length}
    prefix = await backend.open_session({**opening, "session_id": f"{peer:x<32}"}, peer)
    await prefix.reserve(0, length)
    prefix.length = length
    fork = {"session_id": prefix.id, "length": length}
    return prefix, [await backend.open_session({**opening, "fork": fork}, peer) for _ in range(forks)]


def test_park_close_and_info_cost_a_sessions_own_pages_not_every_parked_sessions(span):
    async def scenario(backend):
        prefix, forks = await prefix_and_forks(backend)
        for session in [prefix, *forks]:
            counted(session)
        parks = [work(session.park) for session in [prefix, *forks]]
        infos = [work(backend.info) for _ in range(3)]
        assert backend.info()["parked_sessions"] == FORKS + 1
        assert backend.info()["parked_tokens"] == PREFIX_PAGES * PAGE_TOKENS  # shared pages count once
        closes = [work(forks[index].close) for index in (0, 1)]
        # each touches its own page table once; today's code read every parked session's, twice, per park
        assert max(parks) <= PREFIX_PAGES and infos == [0, 0, 0] and max(closes) <= PREFIX_PAGES, (parks, closes)
        # the cache full: a request of one page evicts the forks and the prefix (only all of them free a page),
        # each eviction costing its own pages (today: every parked session's, once per candidate, and again
        # after each close)
        backend.budget.take_now(backend.budget.free)
        evicted = work(lambda: backend.warm.make_room(lambda: backend.budget.free >= PAGE_TOKENS))
        assert backend.budget.free >= PAGE_TOKENS and backend.info()["parked_sessions"] == 0
        assert evicted <= 2 * (FORKS + 1) * PREFIX_PAGES, evicted
        backend.budget.give_back(backend.budget.used)

    run_scenario(span, scenario, LIMITS, POOL_PAGES)


def test_one_peers_parked_sessions_claim_at_most_the_whole_cache_its_least_recently_used_first(span):
    """A peer's parked forks of a prefix hold one prefix of pages, but each costs an eviction its whole page
    table: past the whole cache in claims, that peer's least recently used parked sessions go; others' stay."""
    limits = ServerLimits(max_session_tokens=8 * PAGE_TOKENS, cache_wait=0.05, max_cache_share_per_peer=1.0,
                          warm_cache_share=1.0)

    async def scenario(backend):
        theirs = await backend.open_session({**OPENING, "max_length": PAGE_TOKENS}, "other")
        theirs.park()  # the least recently used of all
        prefix, forks = await prefix_and_forks(backend, pages=4, forks=3)
        for session in [prefix, *forks]:
            session.park()
        # 4 + 4 x 3 pages claimed on an 8-page cache: the two least recently active forks went (the prefix was
        # active since: each fork of it counts as its use)
        assert [session.closed_because for session in forks] == ["evicted", "evicted", None]
        assert prefix.closed_because is None and theirs.closed_because is None
        assert backend.warm.claimed_tokens("peer") == 8 * PAGE_TOKENS
        assert backend.info()["parked_sessions"] == 3

    run_scenario(span, scenario, limits, 8)


def test_the_pools_counts_of_parked_and_shared_pages_are_exact_after_random_operations(span):
    """Opens, forks, steps (writing shared pages: copies), pushes (which may start a parked session's step),
    rewinds, parks, un-parks and closes in random order: the counts kept page by page equal a recount of every
    session's page tables."""
    rng = random.Random(7)
    limits = ServerLimits(max_session_tokens=4 * PAGE_TOKENS, cache_wait=0.0, max_cache_share_per_peer=1.0,
                          warm_cache_share=0.6)
    opening = {**OPENING, "max_length": 4 * PAGE_TOKENS, "next_positions": 4 * PAGE_TOKENS}

    def recount(backend, opened):  # closed sessions with a step in flight hold their pages until it settles
        pool, holders, parked = backend.span.pool, {}, {}
        for session in opened:
            for table in session.cache.tables:
                for page in table:
                    holders[page] = holders.get(page, 0) + 1
                    parked[page] = parked.get(page, 0) + session.parked
        assert pool.shared_pages == sum(count > 1 for count in holders.values())
        assert pool.parked_only_pages == sum(parked[page] == count for page, count in holders.items())
        assert backend.warm.count == sum(session.parked for session in opened)

    async def scenario(backend):
        opened = []  # a session closed with a step in flight gives its pages back once the step settles
        for index in range(400):
            sessions = list(backend.sessions)
            action = rng.choice(["open", "fork", "step", "push", "park", "close"] if sessions else ["open"])
            session = rng.choice(sessions) if sessions else None
            try:
                if action == "open":
                    opened.append(await backend.open_session(
                        {**opening, "session_id": f"{rng.getrandbits(128):032x}"}, rng.choice(["a", "b"])))
                elif action == "fork":
                    fork = {"session_id": session.id, "length": rng.randint(0, session.length)}
                    opened.append(await backend.open_session(
                        {**opening, "session_id": f"{rng.getrandbits(128):032x}", "fork": fork}, session.peer_id))
                elif action == "step":
                    position = rng.randint(0, session.length)
                    positions = rng.randint(1, 4 * PAGE_TOKENS - position) if position < 4 * PAGE_TOKENS else 0
                    if positions:
                        await session.step([torch.randn(1, positions, HIDDEN)], {"position": position})
                elif action == "push" and session.length < 4 * PAGE_TOKENS:
                    positions = rng.randint(1, 4 * PAGE_TOKENS - session.length)
                    backend.accept_pushes([(torch.randn(1, positions, HIDDEN), {
                        "session_id": session.id, "step_id": index, "position": session.length})])
                elif action == "park":
                    session.park()
                elif action == "close":
                    session.close()
            except Exception as error:  # full, or over a limit: refused
                assert type(error).__module__ == "swarm.protocol", repr(error)
            recount(backend, opened)
            if index % 7 == 0:
                await asyncio.sleep(0.005)  # pushed steps settle meanwhile
        while any(session.busy for session in opened):
            await asyncio.sleep(0.01)

    run_scenario(span, scenario, limits, 12)
