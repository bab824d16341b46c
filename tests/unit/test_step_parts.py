"""Steps under a byte cap per message (swarm/wire.py's step_message_bytes): a client splits a longer step (a long
prompt) into steps of the same session under it, and packs no more short steps in one message than it allows; a
server refuses a message over it before decoding it. The client's real step channel here talks to a real
server's handler (a tiny span, without the network), so that the outputs in parts are checked against the
span's in one pass."""

import asyncio

import pytest
import torch

from swarm.client import step_channel
from swarm.protocol import PAGE_TOKENS, BadRequestError, error_from_wire
from swarm.server import handler as server_handler
from swarm.server.backend import Backend, ServerLimits
from swarm.server.cache import CacheBudget
from swarm.server.handler import BlockHandler
from swarm.server.span import load_span
from swarm.wire import pack, stacked, tensor_bytes, unpack
from tiny_model import build_tiny_model

HIDDEN = 64
CAP = 10 * HIDDEN * 4  # ten positions of one row, float32
OPENING = {"start": 0, "end": 2, "max_length": 8 * PAGE_TOKENS, "batch_size": 1}


@pytest.fixture(scope="module")
def span(tmp_path_factory):
    return load_span(build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", 2), 0, 2)


@pytest.fixture
def capped(monkeypatch):
    for module in (step_channel, server_handler):
        monkeypatch.setattr(module, "step_message_bytes", lambda: CAP)


class ServerStream:
    """Stands in for the client's rpc_steps stream: each message goes to a real server's handler, whose reply
    comes back to the channel."""

    def __init__(self, handler: BlockHandler, channel):
        self.handler, self.channel, self.closed, self.sizes = handler, channel, False, []
        self.tasks = set()

    def send(self, message) -> None:
        self.sizes.append(tensor_bytes(message))
        task = asyncio.ensure_future(self._answer(message))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, message) -> None:
        self.channel.answered(self, await self.handler._reply_to_step_message(message, "client"))

    def close(self) -> None:
        self.closed = True


def run(span, monkeypatch, scenario):
    async def body():
        backend = Backend(span, CacheBudget(8 * PAGE_TOKENS), ServerLimits(max_session_tokens=8 * PAGE_TOKENS,
                                                                           max_sessions_per_peer=8))
        streams = []
        monkeypatch.setattr(step_channel, "_StepStream",
                            lambda channel: streams.append(ServerStream(BlockHandler(backend), channel)) or streams[-1])
        channel = step_channel.StepChannel(p2p=None, peer_id="QmServer", connect_timeout=1.0)
        try:
            await scenario(backend, channel, streams)
            for session in list(backend.sessions):
                session.close()
            assert backend.budget.used == 0
        finally:
            backend.close()

    asyncio.run(body())


def test_a_step_over_the_cap_goes_in_parts_with_the_outputs_of_one_pass(span, monkeypatch, capped):
    """A 37-position prompt went as one message of 37 positions' bytes, whatever its size (a prompt of
    --max-request-tokens: 128 MiB at hidden size 4,096): now as 4 steps of at most 10 positions."""
    prompt, decode = torch.randn(1, 37, HIDDEN), torch.randn(1, 1, HIDDEN)

    async def scenario(backend, channel, streams):
        session = await backend.open_session({**OPENING, "session_id": "a" * 32}, "client")
        entry = {"session_id": "a" * 32, "position": 0, "step_id": 1, "next_positions": 1}
        first = await channel.step(prompt, entry, 10.0, "blocks 0:2")
        second = await channel.step(decode, {**entry, "position": 37, "step_id": 2}, 10.0, "blocks 0:2")
        assert streams[0].sizes == [CAP, CAP, CAP, 7 * HIDDEN * 4, HIDDEN * 4] and session.length == 38
        assert session.push_allowance == 1  # what the step declared, once its last part came
        torch.testing.assert_close(torch.cat([first, second], 1), span(torch.cat([prompt, decode], 1)),
                                   atol=1e-4, rtol=0)

    run(span, monkeypatch, scenario)


def test_short_steps_of_several_sessions_share_messages_only_up_to_the_cap(span, monkeypatch, capped):
    steps = [torch.randn(1, 4, HIDDEN) for _ in range(5)]

    async def scenario(backend, channel, streams):
        for index in range(5):
            await backend.open_session({**OPENING, "session_id": f"{index}" * 32}, "client")
        outputs = await asyncio.gather(*(channel.step(hidden, {"session_id": f"{index}" * 32, "position": 0,
                                                               "step_id": 1}, 10.0, "blocks 0:2")
                                         for index, hidden in enumerate(steps)))
        assert max(streams[0].sizes) <= CAP and len(streams[0].sizes) == 3  # 2 + 2 + 1 steps of 4 positions
        for hidden, output in zip(steps, outputs):
            torch.testing.assert_close(output, span(hidden), atol=1e-4, rtol=0)

    run(span, monkeypatch, scenario)


def test_a_message_over_the_cap_is_refused_before_anything_is_decoded(span, monkeypatch, capped):
    async def scenario(backend, channel, streams):
        session = await backend.open_session({**OPENING, "session_id": "a" * 32}, "client")
        entry = {"session_id": "a" * 32, "position": 0, "step_id": 1, "rows": 1, "length": 11}
        answer = await BlockHandler(backend)._reply_to_step_message(
            pack(stacked([torch.randn(1, 11, HIDDEN)]), {"message_id": 1, "steps": [entry]}), "client")
        tensors, metadata = unpack(answer)
        error = error_from_wire(metadata)
        assert isinstance(error, BadRequestError) and f"cap of {CAP} bytes" in str(error) and tensors == []
        assert session.length == 0 and backend.sessions.positions_served == 0

    run(span, monkeypatch, scenario)
