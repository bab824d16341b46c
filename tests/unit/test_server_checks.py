"""A block server's Backend against what a hostile peer may send, without the network: every refusal is a
SwarmError, and the server's state (sessions, cache) is as if the request never came."""

import asyncio

import pytest
import torch

from swarm.server.span import load_span
from swarm.server.cache import PAGE_TOKENS, CacheBudget
from swarm.protocol import BadRequestError, ServerLimitError
from swarm.server.backend import Backend, ServerLimits
from tiny_model import build_tiny_model

HIDDEN = 64
LIMITS = ServerLimits(max_request_tokens=64, max_session_tokens=48, max_sessions_per_peer=2, cache_wait=0.1)
OPENING = {"start": 0, "end": 2, "max_length": 16, "batch_size": 1}


@pytest.fixture(scope="module")
def span(tmp_path_factory):
    return load_span(build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", 2), 0, 2)


@pytest.fixture
def run_backend(span):
    """Run `scenario(backend)` on a fresh event loop with a fresh Backend, and check nothing is left behind."""

    def run(scenario):
        async def body():
            backend = Backend(span, CacheBudget(4 * PAGE_TOKENS), LIMITS)
            try:
                await scenario(backend)
                assert backend.budget.used == 0 and not backend.sessions and not backend.sessions.per_peer
            finally:
                backend.close()

        asyncio.run(body())

    return run


@pytest.mark.parametrize("tensors, refusal", [
    ([], "one tensor"),
    ([torch.zeros(1, 2, HIDDEN)] * 2, "one tensor"),
    ([torch.zeros(1, 2, HIDDEN + 1)], "shape"),
    ([torch.zeros(2, HIDDEN)], "shape"),
    ([torch.zeros(0, 2, HIDDEN)], "shape"),
    ([torch.zeros(1, 2, HIDDEN, dtype=torch.float64)], "floating point"),
    ([torch.zeros(1, 2, HIDDEN, dtype=torch.complex64)], "floating point"),
    ([torch.zeros(1, 2, HIDDEN, dtype=torch.bool)], "floating point"),
    ([torch.zeros(1, 2, HIDDEN, dtype=torch.int64)], "floating point"),
    ([torch.zeros(1, 2, HIDDEN, dtype=torch.float8_e4m3fn)], "floating point"),
    ([torch.zeros(5, 13, HIDDEN)], "limit of 64 tokens per request"),
])
def test_hidden_states_a_span_cannot_run_are_refused(span, tensors, refusal):
    backend = Backend(span, CacheBudget(PAGE_TOKENS), LIMITS)
    try:
        with pytest.raises(BadRequestError, match=refusal):
            asyncio.run(backend.check_hidden_states(tensors))
    finally:
        backend.close()


@pytest.mark.parametrize("poison", [float("nan"), float("-inf")])
def test_inputs_that_are_not_finite_are_refused_by_their_round_and_poison_nothing(run_backend, span, poison):
    """Checked on the device, in the round, with no host scan before it: the step whose inputs hold a NaN or an
    infinity is refused, the other session's step in the same batch runs, a cache-less forward is refused too,
    and the refused session's next step (at the same position) equals the local model's: nothing not finite
    reached its cache."""
    prompt, nexts = torch.randn(1, 3, HIDDEN), torch.randn(1, 2, HIDDEN)
    bad = nexts.clone().index_fill(2, torch.tensor([3]), poison)

    async def scenario(backend):
        sessions = [await backend.open_session(OPENING, "client") for _ in range(2)]
        for session in sessions:
            await session.step([prompt], {"position": 0})
        refused, ran = await backend.run_steps([(sessions[0], bad, {"position": 3}),
                                               (sessions[1], nexts, {"position": 3})])
        assert isinstance(refused, BadRequestError) and "finite" in str(refused)
        torch.testing.assert_close(ran[:, -2:], span(torch.cat([prompt, nexts], 1))[:, -2:], atol=1e-4, rtol=0)
        # one position: the refused step's second one stays in the cache, masked (a masked NaN still poisons)
        again = await sessions[0].step([nexts[:, :1]], {"position": 3})
        torch.testing.assert_close(again, span(torch.cat([prompt, nexts[:, :1]], 1))[:, -1:], atol=1e-4, rtol=0)
        with pytest.raises(BadRequestError, match="finite"):
            await backend.forward([bad], {"start": 0, "end": 2})
        for session in sessions:
            session.close()

    run_backend(scenario)


@pytest.mark.parametrize("change, refusal", [
    ({"max_length": True}, "max_length"),
    ({"max_length": -1}, "max_length"),
    ({"max_length": 1 << 40}, "max_length"),
    ({"batch_size": 1.0}, "batch_size"),
    ({"start": None}, "start"),
    ({"end": 3}, "end"),
    ({"session_id": "short"}, "session_id"),
    ({"session_id": ["x" * 20]}, "session_id"),
])
def test_malformed_openings_are_refused(run_backend, change, refusal):
    async def scenario(backend):
        with pytest.raises(BadRequestError, match=refusal):
            await backend.open_session({**OPENING, **change}, "peer")

    run_backend(scenario)


def test_limits_on_one_client(run_backend):
    async def scenario(backend):
        with pytest.raises(ServerLimitError, match="limit of 48 tokens per session"):
            await backend.open_session({**OPENING, "max_length": 25, "batch_size": 2}, "peer")
        sessions = [await backend.open_session(OPENING, "peer") for _ in range(2)]
        with pytest.raises(ServerLimitError, match="sessions open"):
            await backend.open_session(OPENING, "peer")
        other = await backend.open_session({**OPENING, "max_length": 24, "batch_size": 2}, "another peer")
        sessions.pop().close()
        sessions.append(await backend.open_session(OPENING, "peer"))  # a closed session makes room again
        for session in [*sessions, other]:
            session.close()

    run_backend(scenario)


def test_a_push_that_differs_from_the_clients_copy_is_run_again(run_backend, span):
    """A previous server that pushes other outputs than it returns to the client changes nothing: the client's
    copy of the inputs is what the session runs."""
    prompt, forged = torch.randn(1, 3, HIDDEN), torch.randn(1, 3, HIDDEN)

    async def scenario(backend):  # the opening declares a first step of 3 positions: a push of 3 is computed
        session = await backend.open_session({**OPENING, "session_id": "s" * 32, "next_positions": 3}, "client")
        assert backend.accept_pushes([(forged, {"session_id": "s" * 32, "step_id": 1, "position": 0})]) == [None]
        output = await session.step([prompt], {"step_id": 1, "position": 0})
        torch.testing.assert_close(output, span(prompt), atol=1e-4, rtol=0)
        session.close()

    run_backend(scenario)


@pytest.mark.parametrize("push", [
    {"step_id": True, "position": 0},
    {"step_id": 1, "position": 5},
    {"step_id": 1, "position": 0, "tensor": torch.zeros(1, 3, HIDDEN + 1)},
    {"session_id": "nobody's" * 4, "step_id": 1, "position": 0},
])
def test_a_bad_push_fails_alone(run_backend, span, push):
    """A malformed push, or one for another session, is refused or dropped; the client's step goes on."""
    prompt = torch.randn(1, 3, HIDDEN)

    async def scenario(backend):
        session = await backend.open_session({**OPENING, "session_id": "s" * 32}, "client")
        metadata = {"session_id": "s" * 32, **push}
        [refusal] = backend.accept_pushes([(metadata.pop("tensor", prompt), metadata)])
        assert refusal is None or isinstance(refusal, BadRequestError)
        output = await session.step([prompt], {"step_id": 1, "position": 0})
        torch.testing.assert_close(output, span(prompt), atol=1e-4, rtol=0)
        session.close()

    run_backend(scenario)
