"""The client's step channel (swarm/client/step_channel.py) over a scripted stream: steps that arrive while a message is
in flight leave together as the next one, a long step never waits, each step keeps its own timeout, and a
failed stream fails only the steps in flight on it."""

import asyncio

import pytest
import torch

from swarm.client import step_channel as stubs
from swarm.client import stubs as client_stubs
from swarm.protocol import BadRequestError, ServerUnavailableError, error_to_wire
from swarm.wire import reply, stacked, unpack, unstacked

HIDDEN = 4


class ScriptedStream:
    """Stands in for one rpc_steps stream: records what the channel sends; the test answers."""

    def __init__(self, channel):
        self.channel, self.closed, self.sent = channel, False, []  # sent: (message_id, session ids, tensors)
        opened.append(self)

    def send(self, message) -> None:
        """The message as the server reads it: one stacked tensor, each step's part of it named by its entry."""
        tensors, metadata = unpack(message)
        steps = unstacked(tensors, metadata["steps"])
        self.sent.append((metadata["message_id"], [step["session_id"] for step in metadata["steps"]], steps))

    def close(self) -> None:
        self.closed = True

    def answer(self, index: int, errors: dict = None) -> None:
        """Reply to the index-th message sent: each step's inputs doubled, or the error given for its session."""
        message_id, sessions, tensors = self.sent[index]
        errors = errors or {}
        outputs = stacked([tensor * 2 for session, tensor in zip(sessions, tensors) if session not in errors])
        results = [error_to_wire(errors[session]) if session in errors else {} for session in sessions]
        self.channel.answered(self, reply(outputs, {"message_id": message_id, "results": results}))


opened: list[ScriptedStream] = []


@pytest.fixture
def channel(monkeypatch):
    opened.clear()
    monkeypatch.setattr(stubs, "_StepStream", ScriptedStream)
    return stubs.StepChannel(p2p=None, peer_id="QmServer", connect_timeout=1.0)


def step(channel, session: str, positions: int = 1, timeout: float = 5.0):
    hidden = torch.full((1, positions, HIDDEN), float(len(session)))
    entry = {"session_id": session, "position": 0, "step_id": 1}
    return asyncio.ensure_future(channel.step(hidden, entry, timeout, "blocks 0:2"))


async def settle():
    for _ in range(3):
        await asyncio.sleep(0)


def test_steps_that_arrive_during_a_message_leave_together_when_it_is_answered(channel):
    async def scenario():
        first = step(channel, "a")
        await settle()
        others = [step(channel, name) for name in ("bb", "ccc", "dddd")]
        await settle()
        stream = opened[0]
        assert [sessions for _, sessions, _ in stream.sent] == [["a"]]  # the first went at once, alone
        stream.answer(0)
        assert (await first)[0, 0, 0] == 2.0
        await settle()
        assert [sessions for _, sessions, _ in stream.sent] == [["a"], ["bb", "ccc", "dddd"]]
        stream.answer(1, errors={"ccc": BadRequestError("no")})
        assert (await others[0])[0, 0, 0] == 4.0 and (await others[2])[0, 0, 0] == 8.0
        with pytest.raises(BadRequestError, match="no"):  # one step's error is that step's alone
            await others[1]
        assert (channel.messages_sent, channel.steps_sent) == (2, 4)

    asyncio.run(scenario())


def test_a_long_step_travels_alone_at_once(channel):
    async def scenario():
        short = step(channel, "a")
        await settle()
        long = step(channel, "bb", positions=stubs.MULTIPLEX_MAX_POSITIONS + 1)
        queued = step(channel, "ccc")
        await settle()
        stream = opened[0]
        assert [sessions for _, sessions, _ in stream.sent] == [["a"], ["bb"]]  # not held up by the first
        stream.answer(1)
        assert (await long).shape == (1, stubs.MULTIPLEX_MAX_POSITIONS + 1, HIDDEN)
        await settle()
        assert len(stream.sent) == 2 and not queued.done()  # short steps still wait for the short message
        stream.answer(0)
        await short
        await settle()
        assert [sessions for _, sessions, _ in stream.sent][-1] == ["ccc"]

    asyncio.run(scenario())


def test_each_step_keeps_its_own_timeout_and_a_silent_stream_is_given_up(channel):
    async def scenario():
        first = step(channel, "a", timeout=0.2)
        await settle()
        late = step(channel, "bb", timeout=0.1)  # queued behind the first, which never comes back
        with pytest.raises(ServerUnavailableError, match="did not answer in time"):
            await late
        with pytest.raises(ServerUnavailableError, match="did not answer in time"):
            await first
        await asyncio.sleep(stubs.EXPIRY_SLACK + 0.1)
        assert opened[0].closed  # the message expired: the stream is closed
        again = step(channel, "ccc")
        await settle()
        assert len(opened) == 2 and opened[1].sent[0][1] == ["ccc"]  # a new stream; the dropped step is not sent
        opened[1].answer(0)
        await again

    asyncio.run(scenario())


def test_a_broken_stream_fails_the_steps_in_flight_and_later_ones_use_a_new_stream(channel):
    async def scenario():
        in_flight = step(channel, "a")
        await settle()
        queued = step(channel, "bb")
        await settle()
        channel.broken(opened[0], "failed: connection reset")
        with pytest.raises(ServerUnavailableError, match="connection reset.*blocks 0:2"):
            await in_flight
        await settle()
        assert opened[0].closed and opened[1].sent[0][1] == ["bb"]  # the queued step was not in flight
        opened[1].answer(0)
        await queued
        opened[0].answer(0)  # a late reply on the old stream changes nothing

    asyncio.run(scenario())


def test_a_reply_that_does_not_add_up_fails_its_steps(channel):
    async def scenario():
        first = step(channel, "a")
        await settle()
        message_id = opened[0].sent[0][0]
        channel.answered(opened[0], reply((), {"message_id": message_id, "results": [{}]}))  # no output
        with pytest.raises(ServerUnavailableError, match="malformed reply|not its steps"):
            await first

    asyncio.run(scenario())


@pytest.mark.parametrize("malform, said", [
    (lambda output: output[..., :-1], "shape"),
    (lambda output: output.double(), "float64"),
    (lambda output: output.fill_(float("inf")), "not finite"),
])
def test_what_cannot_be_a_hops_outputs_is_refused_as_the_servers_fault(malform, said):
    hidden = torch.randn(2, 3, HIDDEN)
    assert client_stubs.checked_outputs(hidden * 2, hidden, "QmServer", "blocks 0:2").shape == hidden.shape
    with pytest.raises(client_stubs.MalformedOutputsError, match=said) as refusal:
        client_stubs.checked_outputs(malform(hidden * 2), hidden, "QmServer", "blocks 0:2")
    assert isinstance(refusal.value, ServerUnavailableError)  # a server fault: the session fails over


def test_a_big_step_is_packed_off_the_event_loop(channel, monkeypatch):
    """Packing copies the whole tensor: a long prompt's would hold up every other session's steps."""
    import threading

    threads = []
    real_pack = stubs.pack
    monkeypatch.setattr(stubs, "pack", lambda *args: threads.append(threading.current_thread()) or real_pack(*args))
    monkeypatch.setattr(stubs, "PACK_OFF_LOOP_VALUES", (stubs.MULTIPLEX_MAX_POSITIONS + 1) * HIDDEN)

    async def scenario():
        small = step(channel, "a", positions=stubs.MULTIPLEX_MAX_POSITIONS + 1)
        big = step(channel, "bb", positions=64)
        for _ in range(50):  # the packing thread's result comes back through the loop
            await asyncio.sleep(0.01)
            if len(opened[0].sent) == 2:
                break
        opened[0].answer(0), opened[0].answer(1)
        await small, await big

    asyncio.run(scenario())
    loop_thread = threading.main_thread()
    assert threads[0] is loop_thread and threads[1] is not loop_thread


def test_short_steps_of_too_many_tokens_for_one_message_go_in_the_next(channel):
    async def scenario():
        first = step(channel, "a")
        await settle()
        rows = stubs.MULTIPLEX_MAX_TOKENS // 2
        waiting = []
        for name in ("bb", "ccc", "dddd"):  # half the tokens a message may carry, each
            hidden = torch.zeros(rows, 1, HIDDEN)
            waiting.append(asyncio.ensure_future(channel.step(hidden, {"session_id": name}, 5.0, "blocks 0:2")))
        await settle()
        stream = opened[0]
        stream.answer(0)
        await first
        await settle()
        stream.answer(1)
        await settle()
        assert [sessions for _, sessions, _ in stream.sent] == [["a"], ["bb", "ccc"], ["dddd"]]
        stream.answer(2)
        await asyncio.gather(*waiting)

    asyncio.run(scenario())
