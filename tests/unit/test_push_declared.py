"""Pushed steps on a block server (ServerSession.pushed), without the network: whoever knows a session's id (the
chain's previous server) can push it a step, so a push is computed only where it is what the client's own next
step will ask for: at the session's length, and of no more positions than the client declared (field
'next_positions', at the opening and in each step), once per declaration. A hostile previous server pushing a
long step made an honest server compute up to max_length positions per step (8,178x what the client asked), its
client's step wait for them, and the client ban the honest server. The client's side: RemoteSession declares,
and asks for no push that the next server would refuse."""

import asyncio

import pytest
import torch

from swarm.protocol import PAGE_TOKENS, BadRequestError
from swarm.server.backend import Backend, ServerLimits
from swarm.server.cache import CacheBudget
from swarm.server.span import load_span
from tiny_model import build_tiny_model

HIDDEN = 64
SESSION = "s" * 32
LIMITS = ServerLimits(max_session_tokens=8 * PAGE_TOKENS, cache_wait=0.1, max_cache_share_per_peer=1.0,
                      warm_cache_share=1.0)
OPENING = {"start": 0, "end": 2, "max_length": 8 * PAGE_TOKENS, "batch_size": 1, "session_id": SESSION}


@pytest.fixture(scope="module")
def span(tmp_path_factory):
    return load_span(build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", 2), 0, 2)


def run(span, scenario):
    async def body():
        backend = Backend(span, CacheBudget(8 * PAGE_TOKENS), LIMITS)
        try:
            await scenario(backend)
            for session in list(backend.sessions):
                session.close()
            assert backend.budget.used == 0 and span.pool.free_pages == 8
        finally:
            backend.close()

    asyncio.run(body())


def push(backend: Backend, hidden: torch.Tensor, step_id: int, position: int):
    [refusal] = backend.accept_pushes([(hidden, {"session_id": SESSION, "step_id": step_id, "position": position})])
    return refusal


async def settled(session) -> None:
    while session.busy:
        await asyncio.sleep(0.005)


def test_a_hostile_push_longer_than_the_clients_next_step_is_not_computed(span):
    prompt, decode, garbage = torch.randn(1, 5, HIDDEN), torch.randn(1, 1, HIDDEN), torch.randn(1, 100, HIDDEN)

    async def scenario(backend):
        session = await backend.open_session(OPENING, "client")
        await session.step([prompt], {"position": 0, "step_id": 1, "next_positions": 1})  # then decode steps
        served, pushed = backend.sessions.positions_served, backend.sessions.steps_pushed
        refusal = push(backend, garbage, 2, 5)  # the previous server pushes 100 positions at the right place
        assert isinstance(refusal, BadRequestError) and "over the 1 the client declared" in str(refusal)
        assert not session.busy and session.length == 5 and backend.sessions.steps_pushed == pushed
        output = await session.step([decode], {"position": 5, "step_id": 2, "next_positions": 1})
        assert backend.sessions.positions_served == served + 1  # the client's own step, and nothing else
        torch.testing.assert_close(output, span(torch.cat([prompt, decode], 1))[:, -1:], atol=1e-4, rtol=0)

    run(span, scenario)


def test_a_push_of_the_declared_size_is_computed_once_and_answers_the_clients_step(span):
    prompt, decode, other = torch.randn(1, 5, HIDDEN), torch.randn(1, 1, HIDDEN), torch.randn(1, 1, HIDDEN)

    async def scenario(backend):
        session = await backend.open_session({**OPENING, "next_positions": 5}, "client")  # its prompt's size
        assert push(backend, prompt, 1, 0) is None and backend.sessions.steps_pushed == 1
        await settled(session)
        first = await session.step([prompt], {"position": 0, "step_id": 1, "next_positions": 1})
        assert backend.sessions.positions_served == 5  # the push's result answered the client's copy
        assert push(backend, decode, 2, 5) is None and backend.sessions.steps_pushed == 2
        await settled(session)
        # one push per declaration: no other is computed before the client's next step
        assert push(backend, other, 3, 6) is None and backend.sessions.steps_pushed == 2
        second = await session.step([decode], {"position": 5, "step_id": 2, "next_positions": 1})
        assert backend.sessions.positions_served == 6 and backend.sessions.steps_pushed == 2
        whole = span(torch.cat([prompt, decode], 1))
        torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=1e-4, rtol=0)

    run(span, scenario)


def test_without_a_declaration_no_push_is_computed(span):
    """A client that declares nothing (one of an older protocol) has every push refused: its own copies run."""

    async def scenario(backend):
        session = await backend.open_session(OPENING, "client")
        refusal = push(backend, torch.randn(1, 1, HIDDEN), 1, 0)
        assert isinstance(refusal, BadRequestError) and "next_positions" in str(refusal)
        assert not session.busy and backend.sessions.steps_pushed == 0

    run(span, scenario)


@pytest.mark.parametrize("value", [-1, True, 1.5, "1", [1]])
def test_a_malformed_declaration_is_refused_naming_the_field(span, value):
    async def scenario(backend):
        with pytest.raises(BadRequestError, match="next_positions"):
            await backend.open_session({**OPENING, "next_positions": value}, "client")
        session = await backend.open_session(OPENING, "client")
        with pytest.raises(BadRequestError, match="next_positions"):
            await session.step([torch.randn(1, 1, HIDDEN)], {"position": 0, "next_positions": value})
        assert session.length == 0

    run(span, scenario)


def test_a_push_to_a_parked_session_unparks_it_and_keeps_the_parked_counts_exact(span):
    """The push's step takes a page of a parked session: the pool counts it as a page in use's."""

    async def scenario(backend):
        session = await backend.open_session({**OPENING, "next_positions": 2 * PAGE_TOKENS}, "client")
        await session.step([torch.randn(1, PAGE_TOKENS, HIDDEN)], {"position": 0, "next_positions": PAGE_TOKENS})
        session.park()
        assert backend.info()["parked_tokens"] == PAGE_TOKENS
        assert push(backend, torch.randn(1, PAGE_TOKENS, HIDDEN), 5, PAGE_TOKENS) is None
        assert not session.parked and backend.info()["parked_tokens"] == 0 and backend.info()["parked_sessions"] == 0
        assert session.cache.pages == 2 and span.pool.parked_only_pages == 0
        await settled(session)
        session.park()
        assert backend.info()["parked_tokens"] == 2 * PAGE_TOKENS

    run(span, scenario)


def test_a_client_declares_its_next_step_and_asks_no_server_for_a_push_the_next_would_refuse():
    """RemoteSession: each step tells each server what the next step may carry (a short step unless the caller
    says more), and a server is asked to push a step on only where the next server was told to expect it."""
    from types import SimpleNamespace

    from swarm.client.peers import Bans
    from swarm.client.remote_session import Hop, RemoteSession
    from swarm.client.routing import ChainLink
    from swarm.client.step_channel import NEXT_STEP_POSITIONS

    class Stream:
        def __init__(self, name):
            self.name, self.calls = name, []

        async def step(self, hidden, position, timeout, step_id, push_to, next_positions, group=0):
            self.calls.append((hidden.shape[1], push_to.name if push_to else None, next_positions))
            return hidden.clone()

    streams = [Stream("first"), Stream("second")]
    session = RemoteSession.__new__(RemoteSession)  # its chain by hand: no network
    session.services = SimpleNamespace(wire_dtype=torch.float32, spot_checks=SimpleNamespace(rate=0), bans=Bans(),
                                       step_timeout=5.0, load=SimpleNamespace(observed=lambda *args: None))
    session.max_length, session.position, session._steps = 1000, 0, 0
    session.next_positions = NEXT_STEP_POSITIONS
    session.hops = [Hop(ChainLink(stream.name, index, index + 1), stream) for index, stream in enumerate(streams)]

    async def scenario():
        await session.step_async(torch.randn(1, 40, HIDDEN))  # a prompt longer than a short step: not pushed
        await session.step_async(torch.randn(1, 1, HIDDEN))  # a decode step: pushed
        await session.step_async(torch.randn(1, 1, HIDDEN), next_positions=100)  # a 100-position chunk next
        await session.step_async(torch.randn(1, 100, HIDDEN), next_positions=1)

    asyncio.run(scenario())
    short = NEXT_STEP_POSITIONS
    assert streams[0].calls == [(40, None, short), (1, "second", short), (1, "second", 100), (100, "second", 1)]
    assert streams[1].calls == [(40, None, short), (1, None, short), (1, None, 100), (100, None, 1)]
    assert session.position == 142


@pytest.mark.parametrize("pushing", [True, False])
def test_a_relayed_step_is_pushed_on_within_what_was_declared_unless_pushes_are_off(pushing):
    from swarm.client.hops import Hop
    from swarm.client.routing import ChainLink

    following = Hop(ChainLink("second", 1, 2), stream=None, declared=8)
    assert following.takes_pushes(1, pushing) is pushing and following.takes_pushes(8, pushing) is pushing
    assert following.takes_pushes(9, pushing) is False  # past what its server was told: never


def test_the_pushed_steps_setting(monkeypatch):
    from swarm.client.hops import pushing_by_default

    monkeypatch.delenv("PUSHED_STEPS", raising=False)
    assert pushing_by_default() is True
    for value, expected in (("0", False), ("1", True), ("no", False)):
        monkeypatch.setenv("PUSHED_STEPS", value)
        assert pushing_by_default() is expected
