"""The message is a block server's unit (swarm/server/step_batch.py): a message of N sessions' steps is one
stacked tensor decoded, one batch of jobs for the compute thread, no task of its own per session, and one reply,
whatever N; its outputs equal each session's steps run alone."""

import asyncio

import pytest
import torch

from server_backends import opened_sessions
from swarm.server import batching
from swarm.server.backend import Backend, ServerLimits
from swarm.server.cache import PAGE_TOKENS, CacheBudget
from swarm.server.handler import BlockHandler
from swarm.server.span import load_span
from swarm.wire import pack, stacked, unpack, unstacked
from tiny_model import build_tiny_model

BLOCKS = 2


@pytest.fixture(scope="module")
def span(tmp_path_factory):
    return load_span(build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", BLOCKS), 0, BLOCKS)


def message(sessions: list, steps: list[torch.Tensor], positions: list[int]):
    entries = [{"session_id": session.id, "position": position, "step_id": position + 1, "rows": 1,
                "length": step.shape[1]} for session, step, position in zip(sessions, steps, positions)]
    return pack(stacked(steps), {"message_id": 7, "steps": entries})


@pytest.mark.parametrize("sessions", [1, 8, 64])
def test_a_message_of_any_number_of_steps_is_one_batch_and_one_reply(span, monkeypatch, sessions):
    """Decode steps and verify steps (1 + a draft) of `sessions` sessions in one message: one batch enqueued
    for the compute thread, no task created while the message is planned and answered, one reply carrying one
    tensor, and each session's outputs as its steps alone through the span give."""
    batches, tasks = [], []
    enqueue = batching.Scheduler._enqueue
    monkeypatch.setattr(batching.Scheduler, "_enqueue", lambda self, jobs: batches.append(len(jobs)) or
                        enqueue(self, jobs))

    async def scenario():
        backend = Backend(span, CacheBudget(sessions * 4 * PAGE_TOKENS), ServerLimits(max_sessions_per_peer=64))
        handler = BlockHandler(backend)
        try:
            opened = await opened_sessions(backend, sessions, BLOCKS)
            prompts = [torch.randn(1, 5 + index % 7, span.config.hidden_size) for index in range(sessions)]
            first = unpack(await handler._reply_to_step_message(message(opened, prompts, [0] * sessions), "peer"))
            steps = [torch.randn(1, 1 if index % 2 else 5, span.config.hidden_size) for index in range(sessions)]
            positions = [prompt.shape[1] for prompt in prompts]
            batches.clear()
            loop = asyncio.get_running_loop()
            loop.set_task_factory(lambda loop, coro, **kwargs: tasks.append(coro) or asyncio.Task(coro, loop=loop,
                                                                                               **kwargs))
            answer = await handler._reply_to_step_message(message(opened, steps, positions), "peer")
            loop.set_task_factory(None)
            for session in opened:
                session.close()
            return first, unpack(answer), prompts, steps
        finally:
            backend.close()

    first, (tensors, metadata), prompts, steps = asyncio.run(scenario())
    assert batches == [sessions] and tasks == []  # one batch of every step, no task of its own for any
    assert len(tensors) == 1 and metadata["results"] == [{}] * sessions and metadata["message_id"] == 7
    shapes = [{"rows": 1, "length": step.shape[1]} for step in steps]
    for prompt, step, prefilled, output in zip(prompts, steps, unstacked(first[0], [
            {"rows": 1, "length": prompt.shape[1]} for prompt in prompts]), unstacked(tensors, shapes)):
        alone = span(torch.cat([prompt, step], dim=1))
        torch.testing.assert_close(torch.cat([prefilled, output], dim=1), alone, atol=1e-4, rtol=0)
