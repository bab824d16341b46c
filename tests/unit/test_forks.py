"""Copy-on-write forks of a block server's sessions, without the network: a fork shares its source's pages of
its first positions instead of copying them; neither ever writes a page the other holds (the one that writes
first takes a private copy, on the event loop); each computes what a fresh session would; and the budget
counts physical pages, whatever the order in which sessions open, fork, write, rewind and close."""

import asyncio
import contextlib
import random
import threading

import pytest
import torch

from swarm.protocol import PAGE_TOKENS, BadRequestError, CacheFullError, ServerLimitError
from swarm.server.backend import Backend, ServerLimits
from swarm.server.span import load_span
from server_backends import run_scenario
from tiny_model import build_tiny_model

HIDDEN = 64
POOL_PAGES = 32
OPENING = {"start": 0, "end": 2, "max_length": 16 * PAGE_TOKENS, "batch_size": 1}
LIMITS = ServerLimits(max_session_tokens=16 * PAGE_TOKENS, cache_wait=0.05, max_cache_share_per_peer=1.0)


@pytest.fixture(scope="module")
def span(tmp_path_factory):
    return load_span(build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", 2), 0, 2)


def run(span, scenario, limits=LIMITS):
    run_scenario(span, scenario, limits, POOL_PAGES, check=assert_consistent)


def assert_consistent(backend: Backend) -> None:
    """Every page in use is paid for once, by its peer: the pool's free pages are the budget's free slots."""
    assert backend.span.pool.free_pages * PAGE_TOKENS == backend.budget.free
    assert sum(backend.cache_by_peer.values()) == backend.budget.used


async def fork(backend: Backend, source, length: int, peer: str = "peer"):
    return await backend.open_session({**OPENING, "session_id": new_id(),
                                       "fork": {"session_id": source.id, "length": length}}, peer)


async def opened(backend: Backend, peer: str = "peer"):
    return await backend.open_session({**OPENING, "session_id": new_id()}, peer)


def new_id() -> str:
    return f"{random.getrandbits(128):032x}"


async def fresh_outputs(backend: Backend, *steps: torch.Tensor) -> list[torch.Tensor]:
    """What a fresh session answers to these steps, one after the other."""
    session = await opened(backend)
    outputs = [await session.step([hidden], {"position": session.length}) for hidden in steps]
    session.close()
    return outputs


@pytest.mark.parametrize("length", [2 * PAGE_TOKENS, 2 * PAGE_TOKENS + 5])  # page-aligned, and mid-page
def test_a_fork_and_its_source_go_on_independently_as_fresh_sessions_would(span, takers, length):
    async def scenario(backend):
        prefix = torch.randn(1, length, HIDDEN)
        ours, theirs = torch.randn(1, 7, HIDDEN), torch.randn(1, 3, HIDDEN)
        source = await opened(backend)
        await source.step([prefix], {"position": 0})
        forked = await fork(backend, source, length)
        assert forked.length == length and span.pool.shared_pages == (3 if length % PAGE_TOKENS else 2)
        # the source writes first, into the page they share mid-page: it takes a copy, the fork reads the original
        shared = forked.cache.tables[0]
        before = [(span.pool.keys[:, page * PAGE_TOKENS : (page + 1) * PAGE_TOKENS].clone(),
                   span.pool.values[:, page * PAGE_TOKENS : (page + 1) * PAGE_TOKENS].clone()) for page in shared]
        source_output = await source.step([ours], {"position": length})
        for page, (keys, values) in zip(shared, before):  # not one value of a shared page written
            assert torch.equal(span.pool.keys[:, page * PAGE_TOKENS : (page + 1) * PAGE_TOKENS], keys)
            assert torch.equal(span.pool.values[:, page * PAGE_TOKENS : (page + 1) * PAGE_TOKENS], values)
        assert source.cache.tables[0][-1] not in shared
        fork_output = await forked.step([theirs], {"position": length})
        assert_consistent(backend)
        torch.testing.assert_close(source_output, (await fresh_outputs(backend, prefix, ours))[1], rtol=0, atol=0)
        torch.testing.assert_close(fork_output, (await fresh_outputs(backend, prefix, theirs))[1], rtol=0, atol=0)
        assert set(takers) == {threading.current_thread().name}  # copies too: only ever on the event loop

    run(span, scenario)


def test_a_source_rewound_and_closed_never_changes_what_its_fork_sees(span):
    async def scenario(backend):
        prefix, edit, after = (torch.randn(1, n, HIDDEN) for n in (3 * PAGE_TOKENS, 4, 2))
        source = await opened(backend)
        await source.step([prefix], {"position": 0})
        forked = await fork(backend, source, 3 * PAGE_TOKENS)
        # rewinds into the first shared page: it copies that one and lets go of the two after it, which the
        # fork now holds alone
        await source.step([edit], {"position": 5})
        assert span.pool.shared_pages == 0 and source.cache.pages == 1
        source.close()
        torch.testing.assert_close(await forked.step([after], {"position": 3 * PAGE_TOKENS}),
                                   (await fresh_outputs(backend, prefix, after))[1], rtol=0, atol=0)

    run(span, scenario)


def test_a_rewind_gives_back_the_pages_past_it_and_goes_on_as_a_fresh_session_would(span):
    async def scenario(backend):
        prefix, draft, accepted = (torch.randn(1, n, HIDDEN) for n in (PAGE_TOKENS - 1, 3 * PAGE_TOKENS, 2))
        session = await opened(backend)
        await session.step([prefix], {"position": 0})
        await session.step([draft], {"position": PAGE_TOKENS - 1})  # four pages, most of them a rejected draft
        free = span.pool.free_pages
        output = await session.step([accepted], {"position": PAGE_TOKENS - 1})
        assert session.cache.pages == 2 and span.pool.free_pages == free + 2  # the two past position 17 went back
        assert_consistent(backend)
        torch.testing.assert_close(output, (await fresh_outputs(backend, prefix, accepted))[1], rtol=0, atol=0)

    run(span, scenario)


def test_eight_forks_of_a_four_page_prefix_take_one_page_each(span):
    async def scenario(backend):
        source = await opened(backend)
        await source.step([torch.randn(1, 4 * PAGE_TOKENS, HIDDEN)], {"position": 0})
        before = span.pool.free_pages
        forks = [await fork(backend, source, 4 * PAGE_TOKENS) for _ in range(8)]
        assert span.pool.free_pages == before and span.pool.shared_pages == 4  # nothing copied
        for forked in forks:
            await forked.step([torch.randn(1, 3, HIDDEN)], {"position": 4 * PAGE_TOKENS})
        assert before - span.pool.free_pages == 8  # a page each for its own tokens, not 8 copies of 4 pages
        assert backend.cache_by_peer == {"peer": (4 + 8) * PAGE_TOKENS}
        assert_consistent(backend)

    run(span, scenario)


def test_pages_and_budget_agree_whatever_the_order_of_opens_forks_writes_rewinds_and_closes(span):
    """A random walk over many sessions of two peers: after every operation, the pool's free pages are the
    budget's free slots, and the per-peer counts add up to the budget's used slots; all come back at the end."""

    async def scenario(backend):
        rng, sessions, refusals = random.Random(22), [], 0
        for _ in range(120):
            action = rng.choice(["open", "fork", "write", "write", "rewind", "close"])
            live = [session for session in sessions if not session.ended.is_set()]
            try:
                await one_operation(backend, rng, action, live, sessions)
            except CacheFullError:  # the cache is full: refused, and what it took came back
                refusals += 1
            assert_consistent(backend)
            assert backend.budget.used <= backend.budget.total

        assert refusals  # the walk ran into a full cache too
        assert backend.span.pool.shared_pages  # and shared pages

    run(span, scenario, ServerLimits(max_session_tokens=16 * PAGE_TOKENS, cache_wait=0.01,
                                     max_cache_share_per_peer=1.0, session_idle_timeout=0))


async def one_operation(backend: Backend, rng: random.Random, action: str, live: list, sessions: list) -> None:
    if action == "open" or not live:
        sessions.append(await opened(backend, rng.choice(["a", "b"])))
    elif action == "fork":
        source = rng.choice(live)
        sessions.append(await fork(backend, source, rng.randint(0, source.length), source.peer_id))
    elif action == "close":
        rng.choice(live).close()
    else:
        session = rng.choice(live)
        position = session.length if action == "write" else rng.randint(0, session.length)
        room = session.max_length - position
        if room > 0:
            await session.step([torch.randn(1, rng.randint(1, min(room, 40)), HIDDEN)], {"position": position})


@pytest.mark.parametrize("fork_field, peer, opening, message", [
    ({"session_id": "0" * 32, "length": 1}, "peer", {}, "names no open session of yours"),
    (None, "other", {}, "names no open session of yours"),  # another peer's session reads as none
    (None, "peer", {"end": 1}, "its source's blocks, batch size and adapter"),
    (None, "peer", {"batch_size": 2, "max_length": PAGE_TOKENS}, "its source's blocks, batch size and adapter"),
    ({"length": PAGE_TOKENS + 1}, "peer", {}, "at most the forked session's length"),
    ({"length": -1}, "peer", {}, "must be an integer in"),
    ({"length": "1"}, "peer", {}, "must be an integer in"),
    ("source", "peer", {}, "field 'fork' must be a map"),
])
def test_a_fork_of_what_cannot_be_forked_is_refused_clearly(span, fork_field, peer, opening, message):
    async def scenario(backend):
        source = await opened(backend)
        await source.step([torch.randn(1, PAGE_TOKENS, HIDDEN)], {"position": 0})
        field = {"session_id": source.id, "length": 4, **fork_field} if isinstance(fork_field, dict) else \
            fork_field if fork_field is not None else {"session_id": source.id, "length": 4}
        with pytest.raises(BadRequestError, match=message):
            await backend.open_session({**OPENING, **opening, "fork": field}, peer)
        assert len(backend.sessions) == 1
        assert_consistent(backend)

    run(span, scenario)


@contextlib.contextmanager
def step_running(session):
    """As if a step of the session were being computed (ServerSession.begin_step ... step_settled)."""
    session.stepping = True
    session._idle.clear()
    try:
        yield
    finally:
        session.stepping = False
        session._idle_if_done()


def test_forks_wait_for_their_sources_step_and_stay_within_the_peers_limit_of_sessions(span):
    """Forks asked for while a step of the source runs wait for it (a round writing the pages they would share
    must be done first); those over the peer's limit of sessions once they may fork are refused, and give back
    what they alone held."""

    async def scenario(backend):
        source = await opened(backend)
        await source.step([torch.randn(1, PAGE_TOKENS + 3, HIDDEN)], {"position": 0})
        with step_running(source):
            waiting = [asyncio.ensure_future(fork(backend, source, PAGE_TOKENS + 3)) for _ in range(3)]
            await asyncio.sleep(0.05)
            assert not any(task.done() for task in waiting) and span.pool.shared_pages == 0
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert sum(isinstance(result, ServerLimitError) for result in results) == 1
        assert span.pool.shared_pages == 2 and len(backend.sessions) == 3
        assert_consistent(backend)

    run(span, scenario, ServerLimits(**{**LIMITS.__dict__, "max_sessions_per_peer": 3}))


def test_a_fork_of_a_source_that_closes_while_it_waits_is_refused(span):
    async def scenario(backend):
        source = await opened(backend)
        await source.step([torch.randn(1, 4, HIDDEN)], {"position": 0})
        with step_running(source):
            waiting = asyncio.ensure_future(fork(backend, source, 4))
            await asyncio.sleep(0.05)
            source.close()
        with pytest.raises(BadRequestError, match="has ended"):
            await waiting
        assert_consistent(backend)

    run(span, scenario)
