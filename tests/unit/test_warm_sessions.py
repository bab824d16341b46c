"""Sessions parked by their clients (kept warm for reuse) on a block server, without the network: the server
evicts them least recently used first when another session needs room or when they hold more than
--warm-cache-share of the cache; a session in use (not parked, or busy) is never evicted; a parked saved prefix
whose pages live on in its forks frees nothing, and is kept. Every page comes back."""


import pytest
import torch

from test_forks import step_running
from swarm.protocol import PAGE_TOKENS, BadRequestError, CacheFullError, ServerLimitError
from swarm.server.backend import Backend, ServerLimits
from swarm.server.handler import _control
from swarm.server.span import load_span
from swarm.wire import pack, unpack
from server_backends import run_scenario
from tiny_model import build_tiny_model

HIDDEN = 64
OPENING = {"start": 0, "end": 2, "max_length": 8 * PAGE_TOKENS, "batch_size": 1}
# 8 pages, all of them for one peer; parked sessions may keep all of them (unless a test says otherwise)
LIMITS = ServerLimits(max_session_tokens=8 * PAGE_TOKENS, cache_wait=0.05, max_cache_share_per_peer=1.0,
                      warm_cache_share=1.0)


@pytest.fixture(scope="module")
def span(tmp_path_factory):
    return load_span(build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", 2), 0, 2)


def run(span, scenario, limits=LIMITS):
    run_scenario(span, scenario, limits, pool_pages=8)


async def stepped(backend: Backend, positions: int = 1, peer: str = "peer", **opening):
    session = await backend.open_session({**OPENING, **opening}, peer)
    await session.step([torch.randn(1, positions, HIDDEN)], {"position": 0})
    return session


def test_a_parked_session_makes_room_for_a_new_one_and_a_session_in_use_does_not(span):
    async def scenario(backend):
        sessions = [await stepped(backend) for _ in range(8)]  # a page each: the cache is full
        with pytest.raises(CacheFullError):  # nothing parked: nothing may be closed for it
            await backend.open_session(OPENING, "peer")
        sessions[5].park()
        sessions[2].park()  # parked later, but active earlier: goes first
        newcomer = await backend.open_session(OPENING, "peer")
        assert [session.closed_because for session in sessions] == [None, None, "evicted"] + [None] * 5
        assert backend.info()["parked_sessions"] == 1 and backend.info()["parked_tokens"] == PAGE_TOKENS
        await sessions[5].step([torch.randn(1, 1, HIDDEN)], {"position": 1})  # a step un-parks it
        assert not sessions[5].parked and backend.info()["parked_sessions"] == 0
        newcomer.close()
        await backend.open_session(OPENING, "peer")
        with pytest.raises(CacheFullError):
            await backend.open_session(OPENING, "peer")
        assert [session.ended.is_set() for session in sessions].count(True) == 1

    run(span, scenario)


def test_a_parked_session_with_a_step_running_is_never_evicted(span):
    async def scenario(backend):
        sessions = [await stepped(backend) for _ in range(8)]
        sessions[0].park()
        with step_running(sessions[0]):  # a step running (it cannot have un-parked it yet)
            with pytest.raises(CacheFullError):
                await backend.open_session(OPENING, "peer")
        assert not sessions[0].ended.is_set()

    run(span, scenario)


def test_growing_into_a_full_cache_evicts_parked_sessions_of_any_peer(span):
    async def scenario(backend):
        theirs = [await stepped(backend, PAGE_TOKENS, peer="other") for _ in range(2)]
        mine = await stepped(backend, 5 * PAGE_TOKENS)
        for session in theirs:
            session.park()
        await mine.step([torch.randn(1, 3 * PAGE_TOKENS, HIDDEN)], {"position": 5 * PAGE_TOKENS})
        assert [session.closed_because for session in theirs] == ["evicted", "evicted"]

    run(span, scenario)


def test_parked_sessions_are_kept_within_their_share_least_recently_used_first(span):
    async def scenario(backend):
        sessions = [await stepped(backend, PAGE_TOKENS) for _ in range(4)]
        for session in sessions:
            session.park()
        assert [session.closed_because for session in sessions] == ["evicted", "evicted", None, None]
        assert backend.info()["parked_tokens"] == 2 * PAGE_TOKENS  # a quarter of the cache

    run(span, scenario, ServerLimits(**{**LIMITS.__dict__, "warm_cache_share": 0.25}))


def test_with_no_warm_share_a_parked_session_is_closed_at_once(span):
    async def scenario(backend):
        session = await stepped(backend)
        session.park()
        assert session.closed_because == "evicted" and backend.budget.used == 0

    run(span, scenario, ServerLimits(**{**LIMITS.__dict__, "warm_cache_share": 0.0}))


def test_a_parked_prefix_shared_with_forks_in_use_is_kept_and_counts_once_they_end(span):
    """A saved prefix (parked) that forks in use share frees nothing if evicted: it stays, and holds none of the
    parked share until the forks are gone; then it counts, and is evicted once over the share."""

    async def scenario(backend):
        prefix = await stepped(backend, 2 * PAGE_TOKENS, session_id="p" * 32)
        forks = [await backend.open_session({**OPENING, "fork": {"session_id": "p" * 32, "length": 2 * PAGE_TOKENS}},
                                            "peer") for _ in range(2)]
        prefix.park()
        assert backend.info()["parked_sessions"] == 1 and backend.info()["parked_tokens"] == 0
        filler = [await stepped(backend) for _ in range(6)]  # the cache is full now
        with pytest.raises(CacheFullError):  # evicting the prefix would free nothing
            await backend.open_session(OPENING, "peer")
        assert not prefix.ended.is_set()
        for session in forks + filler[:4]:
            session.close()
        assert prefix.closed_because == "evicted"  # its 2 pages are over the share of 1 once the forks are gone

    run(span, scenario, ServerLimits(**{**LIMITS.__dict__, "warm_cache_share": 1 / 8}))


def test_a_peer_at_its_limits_makes_room_from_its_own_parked_sessions(span):
    opening = {**OPENING, "max_length": 4 * PAGE_TOKENS}

    async def scenario(backend):
        other = await stepped(backend, peer="other", max_length=4 * PAGE_TOKENS)
        mine = [await stepped(backend, max_length=4 * PAGE_TOKENS) for _ in range(4)]  # its share: 4 pages
        with pytest.raises(ServerLimitError):
            await backend.open_session(opening, "peer")
        mine[1].park()
        await backend.open_session(opening, "peer")  # within its share again
        assert mine[1].closed_because == "evicted" and not other.ended.is_set()

    run(span, scenario, ServerLimits(**{**LIMITS.__dict__, "max_cache_share_per_peer": 0.5,
                                        "max_session_tokens": 4 * PAGE_TOKENS}))


def test_a_peer_at_its_limit_of_sessions_makes_room_from_its_own_parked_sessions(span):
    async def scenario(backend):
        sessions = [await stepped(backend) for _ in range(2)]
        sessions[0].park()
        await backend.open_session(OPENING, "peer")
        assert sessions[0].closed_because == "evicted"
        with pytest.raises(ServerLimitError, match="sessions open"):
            await backend.open_session(OPENING, "peer")

    run(span, scenario, ServerLimits(**{**LIMITS.__dict__, "max_sessions_per_peer": 2}))


def test_an_inference_stream_carries_park_and_nothing_else(span):
    async def scenario(backend):
        session = await stepped(backend)
        for message in (pack(metadata={"park": False}), pack(metadata={"park": True, "x": 1}),
                        pack((torch.zeros(1, 1, HIDDEN),), {"park": True}), pack(metadata={"p": "x" * 100})):
            _, answer = unpack(_control(session, message))
            assert answer["error"]["code"] == BadRequestError.code and not session.parked
        assert unpack(_control(session, pack(metadata={"park": True})))[1] == {"ok": True} and session.parked

    run(span, scenario)


def test_the_warm_share_is_a_server_flag_within_0_and_1(capsys):
    from swarm.server.settings import parse_settings

    peer = ["--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"]
    assert parse_settings(["--blocks", "0:1", *peer]).limits.warm_cache_share == 0.5
    assert parse_settings(["--blocks", "0:1", *peer, "--warm-cache-share", "0"]).limits.warm_cache_share == 0
    with pytest.raises(SystemExit):
        parse_settings(["--blocks", "0:1", *peer, "--warm-cache-share", "1.5"])
    assert "--warm-cache-share must be in [0, 1], got 1.5" in capsys.readouterr().err


def test_a_peer_alone_keeps_its_parked_sessions_past_its_share(span):
    """Its share binds a peer only while other peers use the server: alone, its parked sessions stay."""

    async def scenario(backend):
        short = 4 * PAGE_TOKENS
        parked = [await stepped(backend, max_length=short) for _ in range(3)]
        for session in parked:
            session.park()
        await stepped(backend, max_length=short)
        await stepped(backend, max_length=short)  # 5 pages: over its share of 4, with room to spare
        assert not any(session.ended.is_set() for session in parked)

    run(span, scenario, ServerLimits(**{**LIMITS.__dict__, "max_cache_share_per_peer": 0.5,
                                        "max_session_tokens": 4 * PAGE_TOKENS}))
