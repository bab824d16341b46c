"""A block server's cache among its peers, without the network: a peer alone may take it all; with others
there, one peer is refused past its share (opening or growing a session), and a newcomer within its share gets
room from the idle sessions of peers holding at least as much as it will, least recently active first; a session
idle for the server's timeout is closed. Every page comes back."""

import asyncio

import pytest
import torch

from swarm.protocol import PAGE_TOKENS, CacheFullError, ServerLimitError
from swarm.server.backend import ServerLimits
from swarm.server.span import load_span
from server_backends import run_scenario
from tiny_model import build_tiny_model
from test_forks import step_running

HIDDEN = 64
OPENING = {"start": 0, "end": 2, "max_length": 4 * PAGE_TOKENS, "batch_size": 1}
# 8 pages; a share of half of them (4 pages), sessions of up to 4 pages
LIMITS = ServerLimits(max_session_tokens=4 * PAGE_TOKENS, cache_wait=0.05, max_cache_share_per_peer=0.5)


@pytest.fixture(scope="module")
def span(tmp_path_factory):
    return load_span(build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", 2), 0, 2)


def run(span, scenario, limits=LIMITS):
    run_scenario(span, scenario, limits, pool_pages=8)


def test_a_peer_alone_may_take_the_whole_cache(span):
    async def scenario(backend):
        sessions = [await backend.open_session(OPENING, "gateway") for _ in range(8)]
        assert backend.budget.free == 0 and backend.cache_by_peer == {"gateway": 8 * PAGE_TOKENS}
        sessions[0].close()
        assert backend.cache_by_peer == {"gateway": 7 * PAGE_TOKENS}

    run(span, scenario)


def test_with_another_peer_there_one_is_refused_past_its_share(span):
    async def scenario(backend):
        await backend.open_session(OPENING, "other")
        mine = [await backend.open_session(OPENING, "peer") for _ in range(3)]
        growing = await backend.open_session(OPENING, "peer")  # its fourth page: its share
        with pytest.raises(ServerLimitError, match="over its share of 64"):
            await backend.open_session(OPENING, "peer")
        with pytest.raises(ServerLimitError, match="over its share"):  # growing past it is refused too
            await growing.step([torch.randn(1, PAGE_TOKENS + 1, HIDDEN)], {"position": 0})
        await growing.step([torch.randn(1, PAGE_TOKENS, HIDDEN)], {"position": 0})  # within its page: goes on
        await backend.open_session(OPENING, "other")  # the other peer still gets cache
        mine.pop().close()
        await backend.open_session(OPENING, "peer")  # back within its share
        assert backend.cache_by_peer == {"peer": 4 * PAGE_TOKENS, "other": 2 * PAGE_TOKENS}

    run(span, scenario)


def test_a_newcomer_gets_room_from_the_idle_sessions_of_a_peer_over_its_share(span):
    async def scenario(backend):
        hoarded = [await backend.open_session(OPENING, "first") for _ in range(8)]
        for session in hoarded[:4]:  # stepped later than the others: the others go first
            await session.step([torch.randn(1, 1, HIDDEN)], {"position": 0})
        busy = hoarded[4]
        with step_running(busy):  # a step running: never closed under it
            newcomers = [await backend.open_session(OPENING, "newcomer") for _ in range(3)]
        assert [session.ended.is_set() for session in hoarded] == [False] * 5 + [True] * 3
        assert backend.cache_by_peer == {"first": 5 * PAGE_TOKENS, "newcomer": 3 * PAGE_TOKENS}
        newcomers.append(await backend.open_session(OPENING, "newcomer"))  # the least recently stepped went
        assert busy.ended.is_set() and not hoarded[0].ended.is_set()
        with pytest.raises(ServerLimitError, match="over its share"):  # the newcomer's share is full now
            await backend.open_session(OPENING, "newcomer")

    run(span, scenario)


def test_peers_holding_exactly_their_share_give_room_to_a_third_least_recently_active_first(span):
    """Two identities each hold exactly their share in sessions they never step, and the cache is full: a third
    peer still gets room, from the idle sessions of whoever holds at least as much as it will, least recently
    active first (the old code reclaimed only from peers over their share: the third was refused)."""

    async def scenario(backend):
        first = [await backend.open_session(OPENING, "first") for _ in range(4)]
        second = [await backend.open_session(OPENING, "second") for _ in range(4)]
        await first[0].step([torch.randn(1, 1, HIDDEN)], {"position": 0})  # active lately: goes last
        await backend.open_session(OPENING, "third")
        await backend.open_session(OPENING, "third")
        assert [session.ended.is_set() for session in first] == [False, True, True, False]
        await backend.open_session(OPENING, "third")  # "first" holds 2 pages now, less than the 3 it asks for
        assert [session.ended.is_set() for session in first + second] == [False, True, True, False] + \
            [True, False, False, False]
        with pytest.raises(CacheFullError, match="cache is full"):  # nobody holds 4 pages any more
            await backend.open_session(OPENING, "third")
        assert backend.cache_by_peer == {"first": 2 * PAGE_TOKENS, "second": 3 * PAGE_TOKENS,
                                         "third": 3 * PAGE_TOKENS}

    run(span, scenario)


def test_a_session_idle_for_the_timeout_is_closed_and_a_busy_one_is_not(span):
    async def scenario(backend):
        idle, busy = await backend.open_session(OPENING, "peer"), await backend.open_session(OPENING, "peer")
        with step_running(busy):
            await asyncio.wait_for(idle.ended.wait(), 5)
            assert backend.budget.used == PAGE_TOKENS and not busy.ended.is_set()
        await asyncio.wait_for(busy.ended.wait(), 5)  # once its step ended, and it went idle
        assert backend.budget.used == 0 and not backend.sessions

    run(span, scenario, ServerLimits(session_idle_timeout=0.2))
