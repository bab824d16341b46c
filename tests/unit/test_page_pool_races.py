"""A block server's page pool against the event loop and the compute thread, without the network: the rounds
are run by hand, so that each test replays one interleaving exactly (a session closed after its step entered a
round, a moment later while the round runs, a step whose caller hung up, a rebalance between two chunks of a
cache-less forward). Every page and every budget slot comes back, pages are taken only on the event loop, the
zero page that padded keys read stays zero, and no round writes through one pool's page numbers into another."""

import asyncio
import threading

import pytest
import torch

from swarm.protocol import PAGE_TOKENS, ServerUnavailableError
from swarm.server.attention import PackedBatch
from swarm.server.backend import Backend, ServerLimits
from swarm.server.cache import CacheBudget, KVPool
from swarm.server.span import load_span
from server_backends import run_scenario
from tiny_model import build_tiny_model

HIDDEN = 64
POOL_PAGES = 8
OPENING = {"start": 0, "end": 2, "max_length": 4 * PAGE_TOKENS, "batch_size": 1}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", 2)


@pytest.fixture(scope="module")
def span(folder):
    return load_span(folder, 0, 2)


def hidden(length: int) -> torch.Tensor:
    return torch.randn(1, length, HIDDEN)


async def settle() -> None:
    """Let the results the compute side handed to the loop, and the coroutines they wake, run."""
    for _ in range(5):
        await asyncio.sleep(0)


async def queued(backend: Backend, jobs: int = 1) -> None:
    while len(backend.scheduler._waiting) < jobs:
        await asyncio.sleep(0)


async def on_compute_thread(backend: Backend, round_) -> None:
    """Compute a round on a thread of its own, as the server's compute thread would."""
    await asyncio.to_thread(backend.scheduler._compute_round, round_)
    await settle()


def assert_all_back(backend: Backend, pool: KVPool) -> None:
    assert backend.budget.used == 0 and not backend.cache_by_peer
    assert pool.free_pages == POOL_PAGES
    assert not pool.keys[:, pool.zero_slot : pool.scratch_slot].any()
    assert not pool.values[:, pool.zero_slot : pool.scratch_slot].any()


def run(span, scenario):
    run_scenario(span, scenario, ServerLimits(cache_wait=0.05), POOL_PAGES, settle=False, rounds_by_hand=True)


def test_a_session_closed_after_its_step_entered_a_round_gives_every_page_back(span, takers):
    """Closed (its client failed over) once the compute thread picked its step, before the round ran: the
    round takes no page (the old code's compute thread took two fresh pages into the dead cache, which never
    came back while the budget counted them free), and the session's pages come back once the round is done."""

    async def scenario(backend):
        session = await backend.open_session(OPENING, "peer")
        step = asyncio.ensure_future(session.step([hidden(PAGE_TOKENS + 1)], {"position": 0}))
        await queued(backend)
        round_ = backend.scheduler._next_round()
        session.close()
        held_while_the_round_may_write = backend.budget.used
        await on_compute_thread(backend, round_)
        await asyncio.wait([step])
        assert_all_back(backend, span.pool)
        assert takers and set(takers) == {threading.current_thread().name}  # only ever on the event loop
        assert held_while_the_round_may_write == 2 * PAGE_TOKENS

    run(span, scenario)


def test_a_session_closed_while_its_round_runs_leaves_the_zero_page_zero(span, monkeypatch):
    """Closed a moment later, while the round computes: the round writes the session's own pages, which come
    back after it (the old code gave them back at once, and the round wrote the session's keys into the zero
    page that every padded key reads)."""
    of = PackedBatch.of.__func__

    async def scenario(backend):
        loop = asyncio.get_running_loop()
        session = await backend.open_session(OPENING, "peer")

        async def close():
            session.close()

        def closed_meanwhile(cls, *args, **kwargs):  # on the compute thread, as the round builds its batch
            asyncio.run_coroutine_threadsafe(close(), loop).result(10)
            return of(cls, *args, **kwargs)

        monkeypatch.setattr(PackedBatch, "of", classmethod(closed_meanwhile))
        step = asyncio.ensure_future(session.step([hidden(5)], {"position": 0}))
        await queued(backend)
        await on_compute_thread(backend, backend.scheduler._next_round())
        await asyncio.wait([step])
        assert session.ended.is_set()
        assert_all_back(backend, span.pool)

    run(span, scenario)


def test_a_step_whose_caller_hung_up_keeps_its_session_busy_until_its_round_is_done(span):
    """The client hung up (its step's task cancelled) while the step was in a round: the session counts as
    busy until the round is done, so that neither the idle timer nor a reclaim closes it under the round."""

    async def scenario(backend):
        session = await backend.open_session(OPENING, "peer")
        step = asyncio.ensure_future(session.step([hidden(3)], {"position": 0}))
        await queued(backend)
        round_ = backend.scheduler._next_round()
        step.cancel()
        await asyncio.wait([step])
        assert session.busy
        session.close()
        assert backend.budget.used == PAGE_TOKENS
        await on_compute_thread(backend, round_)
        assert not session.busy
        assert_all_back(backend, span.pool)

    run(span, scenario)


def test_a_session_closed_while_its_step_is_queued_gives_every_page_back(span):
    async def scenario(backend):
        session = await backend.open_session(OPENING, "peer")
        step = asyncio.ensure_future(session.step([hidden(PAGE_TOKENS + 1)], {"position": 0}))
        await queued(backend)
        session.close()
        assert backend.scheduler._next_round() == []  # dropped: it was no longer wanted
        await settle()
        with pytest.raises(ServerUnavailableError):
            await step
        assert_all_back(backend, span.pool)

    run(span, scenario)


def test_a_rebalance_between_two_chunks_of_a_forward_fails_it_and_writes_no_other_pool(folder):
    """A cache-less forward of 3 pages, computed 8 positions a round through a temporary cache of the old
    span's pool; the server moves to another span between two rounds, and a session of the new span fills
    the new pool's first pages. The forward fails with an error the client retries, its temporary cache comes
    back, and the new session's keys and values are untouched (the old code's next rounds wrote the forward's
    keys through its old page numbers into the new pool: over that session's cache)."""
    old, new = load_span(folder, 0, 2), load_span(folder, 0, 2)
    length = 3 * PAGE_TOKENS

    async def scenario():
        backend = Backend(old, CacheBudget(1024), ServerLimits(), prefill_chunk_tokens=8)
        backend.scheduler.stop()
        try:
            forward = asyncio.ensure_future(backend.forward([hidden(length)], {"start": 0, "end": 2}))
            await queued(backend)
            await on_compute_thread(backend, backend.scheduler._next_round())
            backend.move_to(new)
            other = new.new_cache(1, length)
            new(hidden(length), 0, other)
            before = [part.clone() for layer in range(2) for part in other.read(layer, length)]
            while not forward.done() and backend.scheduler._waiting:
                await on_compute_thread(backend, backend.scheduler._next_round())
            after = [part for layer in range(2) for part in other.read(layer, length)]
            assert all(torch.equal(was, now) for was, now in zip(before, after))
            with pytest.raises(ServerUnavailableError, match="moved to other blocks"):
                await forward
            assert backend.budget.used == 0 and old.pool.free_pages == 1024 // PAGE_TOKENS
        finally:
            backend.close()

    asyncio.run(scenario())


def test_a_round_refuses_caches_of_another_pool_or_without_their_pages(folder):
    """The span's own guard, whatever calls it: a cache of another pool is a retriable refusal, and positions
    past a cache's pages an error, before anything is written."""
    from swarm.server.attention import Segment

    span = load_span(folder, 0, 2)
    cache = span.new_cache(1, PAGE_TOKENS)
    with pytest.raises(RuntimeError, match="lacks the pages"):
        span.forward_packed(hidden(2), [Segment(1, 2, PAGE_TOKENS - 1, cache)])
    span.new_pool(1024)
    with pytest.raises(ServerUnavailableError, match="moved to other blocks"):
        span.forward_packed(hidden(1), [Segment(1, 1, 0, cache)])
