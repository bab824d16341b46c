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


def step(channel, session: str, positions: int = 1, timeout: float = 5.0, group: int = 0):
    hidden = torch.full((1, positions, HIDDEN), float(len(session)))
    entry = {"session_id": session, "position": 0, "step_id": 1}
    return asyncio.ensure_future(channel.step(hidden, entry, timeout, "blocks 0:2", group))


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


def test_a_message_carries_one_group_and_the_next_group_goes_when_it_is_answered(channel):
    """The engine loop's pipeline: groups reach a server one after the other, so that while this server computes
    one group the next server of the chain computes the group before."""

    async def scenario():
        steps = [step(channel, name, group=index % 2) for index, name in enumerate(("a", "bb", "ccc", "dddd"))]
        await settle()
        stream = opened[0]
        assert [sessions for _, sessions, _ in stream.sent] == [["a", "ccc"]]  # group 0 at once, group 1 waits
        stream.answer(0)
        await settle()
        assert [sessions for _, sessions, _ in stream.sent] == [["a", "ccc"], ["bb", "dddd"]]
        later = step(channel, "eeeee", group=0)  # group 0's next step waits for group 1's message
        await settle()
        assert len(stream.sent) == 2
        stream.answer(1)
        await settle()
        assert [sessions for _, sessions, _ in stream.sent][-1] == ["eeeee"]
        stream.answer(2)
        assert [float((await done)[0, 0, 0]) for done in (*steps, later)] == [2.0, 4.0, 6.0, 8.0, 10.0]

    asyncio.run(scenario())


def test_a_step_costs_no_timer_of_its_own_and_a_message_one(channel):
    """What a message of many steps costs the event loop: one expiry timer for the message, none per step (a timer
    per step and hop cost more than the step itself), and no task beside the caller's."""

    async def scenario():
        loop = asyncio.get_running_loop()
        timers, tasks = [], []
        call_later, create_task = loop.call_later, loop.create_task
        loop.call_later = lambda *args, **kwargs: timers.append(args) or call_later(*args, **kwargs)
        loop.create_task = lambda *args, **kwargs: tasks.append(args) or create_task(*args, **kwargs)
        steps = [asyncio.ensure_future(channel.step(torch.ones(1, 1, HIDDEN), {"session_id": str(index)}, 5.0,
                                                    "blocks 0:2")) for index in range(64)]
        created = len(tasks)  # the callers' own 64
        await settle()
        opened[0].answer(0)
        await asyncio.gather(*steps)
        assert (len(timers), len(tasks) - created, channel.messages_sent) == (1, 0, 1)

    asyncio.run(scenario())


def test_a_reply_adds_its_round_trip_and_the_servers_timings_to_the_stage_clock(channel, monkeypatch):
    from swarm.client import stage_clock

    from swarm.client import step_replies

    clock = stage_clock.StageClock()
    monkeypatch.setattr(stubs, "CLOCK", clock)  # what the channel adds as a message leaves
    monkeypatch.setattr(step_replies, "CLOCK", clock)  # and as its reply comes

    async def scenario():
        first, second = step(channel, "a"), step(channel, "bb")
        await settle()
        message_id, sessions, tensors = opened[0].sent[0]
        await asyncio.sleep(0.002)  # the server's time, within the round trip the client sees
        timings = {"decode": 0.0001, "queue": 0.0002, "compute": 0.0003, "reply": 0.0001, "total": 0.0007}
        outputs = stacked([tensor * 2 for tensor in tensors])
        channel.answered(opened[0], reply(outputs, {"message_id": message_id, "results": [{}, {}],
                                                    "timings": timings}))
        await first, await second

    asyncio.run(scenario())
    seconds = {stage: total for (stage, blocks), (total, _) in clock.snapshot().items()}
    events = {stage: count for (stage, blocks), (_, count) in clock.snapshot().items()}
    assert {blocks for stage, blocks in clock.snapshot()} == {"0:2"}
    assert events["hop_queue"] == events["hop_round_trip"] == events["server_compute"] == 2  # per step
    assert events["server_busy"] == 1  # per message: the server's time computing
    assert seconds["server_compute"] == pytest.approx(2 * 0.0003) and seconds["server_busy"] == pytest.approx(0.0003)
    assert seconds["hop_transport"] == pytest.approx(seconds["hop_round_trip"] - 2 * 0.0007)


def test_the_stage_clock_ignores_timings_a_server_made_up():
    from swarm.client.stage_clock import StageClock

    clock = StageClock()
    for timings in (None, [], {"compute": "1"}, {"compute": -1.0}, {"compute": 1e9}, {"elsewhere": 0.1}, {"total": 1}):
        clock.add_server_timings(timings, "0:2", 1)
    assert clock.snapshot() == {}
    clock.add_server_timings({"compute": 0.25}, "0:2", 4)
    assert clock.snapshot() == {("server_compute", "0:2"): (1.0, 4)}
