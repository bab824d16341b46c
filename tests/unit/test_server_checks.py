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
    ([torch.full((1, 2, HIDDEN), float("nan"))], "finite"),
    ([torch.zeros(1, 2, HIDDEN).index_fill(2, torch.tensor([3]), float("-inf"))], "finite"),
])
def test_hidden_states_a_span_cannot_run_are_refused(span, tensors, refusal):
    backend = Backend(span, CacheBudget(PAGE_TOKENS), LIMITS)
    try:
        with pytest.raises(BadRequestError, match=refusal):
            asyncio.run(backend.check_hidden_states(tensors))
    finally:
        backend.close()


def test_a_long_request_is_scanned_for_nan_off_the_event_loop(span, monkeypatch):
    """Scanning a long prompt's hidden states takes the event loop's time from every other session's steps: past
    FINITE_SCAN_OFF_LOOP_VALUES values it runs on a thread; a short one stays on the loop (a thread hop costs more)."""
    import threading

    from swarm.server import backend as backend_module

    scanned_on = []
    monkeypatch.setattr(backend_module, "FINITE_SCAN_OFF_LOOP_VALUES", 2 * HIDDEN)
    monkeypatch.setattr(backend_module, "all_finite",
                        lambda hidden: scanned_on.append(threading.current_thread()) or True)
    backend = Backend(span, CacheBudget(PAGE_TOKENS), LIMITS)

    async def check(length: int):
        await backend.check_hidden_states([torch.zeros(1, length, HIDDEN)])
        return threading.current_thread()

    try:
        assert asyncio.run(check(2)) is scanned_on[0]
        assert asyncio.run(check(3)) is not scanned_on[1]
    finally:
        backend.close()


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

    async def scenario(backend):
        session = await backend.open_session({**OPENING, "session_id": "s" * 32}, "client")
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
