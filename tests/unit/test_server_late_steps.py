"""Fields and ids of steps and pushes on a block server, without the network (a real span, backend and handler):
a step entry's 'rows' or 'length' that is a bool, a hostile push's far step id, and steps and pushes that come
after their session's close."""

import asyncio
import logging

import pytest
import torch

from swarm.protocol import BadRequestError, SessionClosedError, error_from_wire
from swarm.server.backend import Backend
from swarm.server.fields import MAX_STEP_ID
from swarm.server.handler import BlockHandler
from swarm.wire import pack, stacked, unpack
from server_backends import run_scenario
from test_push_declared import HIDDEN, LIMITS, OPENING, SESSION, span  # noqa: F401 (span: the fixture)


def run(span, scenario):
    """`scenario(backend, handler)` on a backend of 8 pages, which every session's close must leave whole."""
    run_scenario(span, lambda backend: scenario(backend, BlockHandler(backend)), LIMITS, pool_pages=8)


def push(backend: Backend, hidden: torch.Tensor, step_id, position: int):
    [refusal] = backend.accept_pushes([(hidden, {"session_id": SESSION, "step_id": step_id, "position": position})])
    return refusal


async def step_message(handler: BlockHandler, steps: list, entries: list) -> tuple[list, dict]:
    return unpack(await handler._reply_to_step_message(pack(stacked(steps), {"message_id": 3, "steps": entries}),
                                                       "client"))


@pytest.mark.parametrize("field", ["rows", "length"])
def test_a_bool_for_a_steps_rows_or_length_is_a_bad_request_without_a_traceback(span, field, caplog):
    """msgpack's true is a Python int: it passed the integer check, and a message with another step of 2 rows
    failed decoding with a TypeError, logged with its traceback as the server's own failure."""

    async def scenario(backend, handler):
        await backend.open_session(OPENING, "client")
        entries = [{"session_id": SESSION, "position": 0, "step_id": 1, "rows": 1, "length": 1, field: True},
                   {"session_id": "t" * 32, "position": 0, "step_id": 1, "rows": 2, "length": 2}]
        with caplog.at_level(logging.ERROR):
            tensors, metadata = await step_message(handler, [torch.randn(1, 1, HIDDEN), torch.randn(2, 2, HIDDEN)],
                                                   entries)
        error = error_from_wire(metadata)
        assert isinstance(error, BadRequestError) and "'rows' and 'length'" in str(error) and tensors == []
        assert metadata["message_id"] == 3 and not [record for record in caplog.records if record.exc_info]

    run(span, scenario)


def test_a_hostile_push_of_a_far_step_id_leaves_the_next_pushes_on(span):
    """A push's step id counted as the session's newest at once: one of 2**63 - 1 made every later push of the
    session look stale, and pushes were off for it for good."""
    prompt, decode = torch.randn(1, 5, HIDDEN), torch.randn(1, 1, HIDDEN)

    async def scenario(backend, handler):
        session = await backend.open_session({**OPENING, "next_positions": 5}, "client")
        for far in (MAX_STEP_ID + 1, 2**63 - 1, -1, True, 1.0):  # out of bounds, or not an integer
            refusal = push(backend, prompt, far, 0)
            assert isinstance(refusal, BadRequestError) and "step_id" in str(refusal)
        assert push(backend, prompt, MAX_STEP_ID, 0) is None and backend.sessions.steps_pushed == 1  # in bounds
        first = await session.step([prompt], {"position": 0, "step_id": 1, "next_positions": 1})
        assert backend.sessions.positions_served == 10  # the hostile push's, then the client's own copy
        assert push(backend, decode, 2, 5) is None and backend.sessions.steps_pushed == 2  # pushes still on
        while session.busy:
            await asyncio.sleep(0.005)
        second = await session.step([decode], {"position": 5, "step_id": 2, "next_positions": 1})
        assert backend.sessions.positions_served == 11  # the honest push answered the client's step
        whole = span(torch.cat([prompt, decode], 1))
        torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=1e-4, rtol=0)

    run(span, scenario)


def test_a_step_id_out_of_bounds_in_a_clients_step_is_refused_naming_the_field(span):
    async def scenario(backend, handler):
        session = await backend.open_session(OPENING, "client")
        with pytest.raises(BadRequestError, match="step_id"):
            await session.step([torch.randn(1, 1, HIDDEN)], {"position": 0, "step_id": 2**64})
        assert session.length == 0 and not session.busy

    run(span, scenario)


def test_a_step_and_a_push_after_the_close_are_refused_and_the_id_is_dead(span):
    """A step or a push that crosses its session's close on the way is refused and allocates nothing; and the id
    is never taken over by a new session, which a late push of the old one would otherwise step."""
    hidden = torch.randn(1, 1, HIDDEN)

    async def scenario(backend, handler):
        session = await backend.open_session({**OPENING, "next_positions": 1}, "client")
        await session.step([hidden], {"position": 0, "step_id": 1, "next_positions": 1})
        session.close()
        assert backend.budget.used == 0
        entry = {"session_id": SESSION, "position": 1, "step_id": 2, "rows": 1, "length": 1}
        tensors, metadata = await step_message(handler, [hidden], [entry])
        assert isinstance(error_from_wire(metadata["results"][0]), SessionClosedError) and tensors == []
        assert isinstance(push(backend, hidden, 2, 1), SessionClosedError)
        with pytest.raises(BadRequestError, match="session_id"):
            await backend.open_session(OPENING, "client")
        assert backend.budget.used == 0 and len(backend.sessions) == 0 and span.pool.free_pages == 8
        assert backend.sessions.positions_served == 1 and backend.sessions.steps_pushed == 0

    run(span, scenario)
