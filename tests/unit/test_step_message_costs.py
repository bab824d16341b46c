"""What one step message costs a block server, counted so that it cannot grow back unseen: a message of 1 step
and one of 64 take the same number of asyncio tasks (none), of hand-offs between the event loop and the compute
thread (one each way), of rounds, and of torch operators per round; and the reply says what the message cost in
seconds (metadata "timings", swarm/server/timings.py)."""

import asyncio
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from op_counts import count_torch_ops
from server_backends import opened_sessions
from swarm.server import batching
from swarm.server.backend import Backend, ServerLimits
from swarm.server.cache import PAGE_TOKENS, CacheBudget
from swarm.server.handler import BlockHandler
from swarm.server.span import load_span
from swarm.wire import pack, stacked, unpack
from tiny_model import build_tiny_model

BLOCKS = 2
TIMINGS = ("decode", "queue", "compute", "reply", "total")
# torch operators of a round of the tiny Llama's 2 blocks, for 1 row as for 64, decode steps or verify steps (1 + a
# draft, all of one length: their queries need no reordering either): per round (the packed batch, rotary, masks)
# + per layer; a lone session's keys and values are read in place (its pages lie one after another), not gathered.
# For 4 blocks: 357 a decode round and 381 a verify round before the round's fixed cost was cut
ROUND_OPS = {"alone": 37 + 60 * BLOCKS, "gathered": 37 + 62 * BLOCKS}
# around the round, whatever the number of steps (there were 5 a step on the loop and 8 on the compute thread):
# on the loop, the reply's one concatenation of the outputs and the message's tensor decoded, split into steps
# and checked; on the compute thread, the inputs checked for finite values, the outputs split (and the inputs
# concatenated, where a round has more than one step)
LOOP_OPS, COMPUTE_OPS = 6, 12
POSITIONS = {"decode": 1, "verify": 5}


@pytest.fixture(scope="module")
def span(tmp_path_factory):
    return load_span(build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", BLOCKS), 0, BLOCKS)


def message(sessions: list, steps: list[torch.Tensor], positions: list[int]):
    entries = [{"session_id": session.id, "position": position, "step_id": position + 1, "rows": 1,
                "length": step.shape[1]} for session, step, position in zip(sessions, steps, positions)]
    return pack(stacked(steps), {"message_id": 7, "steps": entries})


class Counted:
    """What answering one message did: tasks created on the loop, callbacks handed to it from other threads,
    wake-ups of the compute thread, rounds computed and the torch operators of each, and the torch operators
    issued around the rounds on the compute thread (launching a round, delivering its outputs)."""

    def __init__(self, monkeypatch, span):
        self.counts: Counter[str] = Counter()
        self.round_ops: list[int] = []
        self.counting = False
        notify, forward = batching.threading.Condition.notify, span.forward_packed

        def counted_notify(condition, *args):
            self.counts["compute thread wake-ups"] += self.counting
            return notify(condition, *args)

        monkeypatch.setattr(batching.threading.Condition, "notify", counted_notify)
        monkeypatch.setattr(span, "forward_packed", self.counted("round ops", forward, self.round_ops))
        for name in ("_launch", "_deliver"):  # on the compute thread, whose dispatch modes are its own
            monkeypatch.setattr(batching.Scheduler, name, self.counted("compute ops", getattr(batching.Scheduler,
                                                                                               name)))

    def counted(self, key: str, function, each: list = None):
        """`function`, whose torch operators are added to counts[key] (and appended to `each`) while counting."""

        def run(*args, **kwargs):
            if not self.counting:
                return function(*args, **kwargs)
            outputs = []
            ops = count_torch_ops(lambda: outputs.append(function(*args, **kwargs)))
            self.counts[key] += ops
            if each is not None:
                each.append(ops)
            return outputs[0]

        return run

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Count the loop's new tasks and its callbacks from other threads."""
        handed = loop.call_soon_threadsafe

        def counted_call(callback, *args, **kwargs):
            self.counts["loop wake-ups from other threads"] += self.counting
            return handed(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted_call
        loop.set_task_factory(lambda loop, coro, **kwargs: self.counts.update(
            {"tasks": self.counting}) or asyncio.Task(coro, loop=loop, **kwargs))


class OpCounter(TorchDispatchMode):
    """The torch operators run on this thread within the block (count_torch_ops for a block that awaits)."""

    calls = 0

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        self.calls += 1
        return op(*args, **(kwargs or {}))


def answered(span, monkeypatch, sessions: int, positions: int = 1):
    """A message of `sessions` steps of `positions` positions each (after a message of their prompts) answered by
    a real backend: the reply's metadata, and what answering it counted (Counted)."""
    counted = Counted(monkeypatch, span)

    async def scenario():
        counted.watch(asyncio.get_running_loop())
        backend = Backend(span, CacheBudget(sessions * 4 * PAGE_TOKENS), ServerLimits(max_sessions_per_peer=64))
        handler = BlockHandler(backend)
        try:
            opened = await opened_sessions(backend, sessions, BLOCKS)
            prompts = [torch.randn(1, 5 + index % 7, span.config.hidden_size) for index in range(sessions)]
            await handler._reply_to_step_message(message(opened, prompts, [0] * sessions), "peer")
            steps = [torch.randn(1, positions, span.config.hidden_size) for _ in range(sessions)]
            request = message(opened, steps, [prompt.shape[1] for prompt in prompts])
            counted.counting = True
            with OpCounter() as loop_ops:  # the loop's own: only this message's task runs meanwhile
                answer = await handler._reply_to_step_message(request, "peer")
            counted.counts["loop ops"] = loop_ops.calls
            counted.counting = False  # the compute thread may still be delivering: its count comes in on return
            for session in opened:
                session.close()
            return unpack(answer)[1]
        finally:
            backend.close()
            backend.scheduler._thread.join(10)  # done delivering: its counts are in

    return asyncio.run(scenario()), counted


@pytest.mark.parametrize("kind", ["decode", "verify"])
@pytest.mark.parametrize("sessions", [1, 2, 64])
def test_a_message_costs_one_hand_off_each_way_and_one_round_whatever_its_steps(span, monkeypatch, sessions, kind):
    metadata, counted = answered(span, monkeypatch, sessions, POSITIONS[kind])
    assert metadata["results"] == [{}] * sessions
    # one round of the 2 tiny blocks, as many torch operators for 64 rows as for 2 (a layer's calls are per round)
    round_ops = ROUND_OPS["alone" if sessions == 1 else "gathered"]
    assert counted.round_ops == [round_ops]
    assert counted.counts == {"tasks": 0, "compute thread wake-ups": 1, "loop wake-ups from other threads": 1,
                              "round ops": round_ops, "compute ops": round_ops + COMPUTE_OPS + (sessions > 1),
                              "loop ops": LOOP_OPS}


def test_the_reply_says_what_the_message_cost(span, monkeypatch):
    metadata, _ = answered(span, monkeypatch, 3)
    timings = metadata["timings"]
    assert set(timings) == set(TIMINGS) and all(isinstance(timings[name], float) for name in TIMINGS)
    assert all(timings[name] >= 0 and round(timings[name], 6) == timings[name] for name in TIMINGS)
    assert timings["compute"] > 0  # its round ran
    parts = timings["decode"] + timings["queue"] + timings["compute"] + timings["reply"]
    assert parts <= timings["total"] + 4e-6  # the parts never overlap (each is rounded: a few microseconds)


def test_a_message_of_refused_steps_only_spent_nothing_computing(span):
    async def scenario():
        backend = Backend(span, CacheBudget(4 * PAGE_TOKENS), ServerLimits(max_sessions_per_peer=64))
        try:
            hidden = torch.randn(1, 1, span.config.hidden_size)
            request = pack(stacked([hidden]), {"message_id": 1, "steps": [{"session_id": "nobody", "position": 0,
                                                                             "rows": 1, "length": 1}]})
            return unpack(await BlockHandler(backend)._reply_to_step_message(request, "peer"))[1]
        finally:
            backend.close()

    metadata = asyncio.run(scenario())
    assert metadata["results"][0]["error"]["code"]
    assert metadata["timings"]["queue"] == metadata["timings"]["compute"] == 0.0
    assert metadata["timings"]["total"] >= metadata["timings"]["decode"]



@pytest.mark.parametrize("sessions", [1, 64])
def test_a_step_stream_answers_each_message_in_one_task_of_its_own(span, monkeypatch, sessions):
    """A step stream's reader (rpc_steps) starts one task per message, which answers it (so that a long message
    does not hold up a short one), whatever its number of steps, and nothing else (no task to take its slot)."""
    counted = Counted(monkeypatch, span)

    async def scenario():
        backend = Backend(span, CacheBudget(sessions * 4 * PAGE_TOKENS), ServerLimits(max_sessions_per_peer=64))
        handler = BlockHandler(backend)
        try:
            opened = await opened_sessions(backend, sessions, BLOCKS)
            prompts = [torch.randn(1, 5, span.config.hidden_size) for _ in range(sessions)]
            steps = [torch.randn(1, 1, span.config.hidden_size) for _ in range(sessions)]

            replies: asyncio.Queue = asyncio.Queue()
            answers = []

            async def requests():  # the steps once their prompts are answered, as a client sends them
                yield message(opened, prompts, [0] * sessions)
                answers.append(await replies.get())
                yield message(opened, steps, [5] * sessions)

            slots = handler.flow.open_stream("peer", end=lambda: None)
            counted.watch(asyncio.get_running_loop())
            counted.counting = True
            await handler._read_step_messages(requests(), "peer", slots, replies)
            counted.counting = False
            answers += [replies.get_nowait() for _ in range(2)]
            assert answers[2] is None and all(unpack(reply)[1]["results"] == [{}] * sessions
                                              for reply, _ in answers[:2])
        finally:
            backend.close()
            backend.scheduler._thread.join(10)

    asyncio.run(scenario())
    assert counted.counts["tasks"] == 2  # one per message
