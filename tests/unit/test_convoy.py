"""Convoys (swarm/client/convoy.py): a tick's steps of sessions sharing a chain move through it as one task with one
future per hop, over real RemoteSessions, hops and step channels whose streams a script answers; a step that
fails at a hop goes on alone from there, and the others are not held up by it."""

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from swarm.client import step_channel
from swarm.client.chain_search import ChainLink
from swarm.client.hops import Hop
from swarm.client.remote_model import RemoteModel
from swarm.client.remote_session import RemoteSession
from swarm.client.step_channel import StepChannels
from swarm.client.stubs import InferenceStream
from swarm.protocol import BadRequestError, ServerUnavailableError, error_to_wire
from swarm.wire import reply, stacked, unpack, unstacked

HIDDEN = 4
ADDS = {"A": 1.0, "B": 10.0}  # what each server adds to its inputs
REFUSALS: dict = {}  # (peer id, session id): the error its step is answered with


class AnsweringStream:
    """Stands in for a channel's rpc_steps stream to server A (blocks 0:2) or B (2:4): each message is answered on
    the next turn of the loop, each step's inputs plus the server's ADDS, or its REFUSALS."""

    def __init__(self, channel):
        self.channel, self.closed = channel, False

    def send(self, message) -> None:
        tensors, metadata = unpack(message)
        entries, peer = metadata["steps"], self.channel.peer_id
        inputs = unstacked(tensors, entries)
        errors = [REFUSALS.get((peer, entry["session_id"])) for entry in entries]
        outputs = stacked([hidden + ADDS[peer] for hidden, error in zip(inputs, errors) if error is None])
        results = [error_to_wire(error) if error is not None else {} for error in errors]
        answer = reply(outputs, {"message_id": metadata["message_id"], "results": results})
        asyncio.get_running_loop().call_soon(self.channel.answered, self, answer)

    def close(self) -> None:
        self.closed = True


def session_on(services, channels) -> RemoteSession:
    """A session whose chain is A (0:2) then B (2:4), opened already."""
    session = RemoteSession.__new__(RemoteSession)
    session.services, session.max_length, session.batch_size, session.on_wait = services, 64, 1, None
    session.position, session.next_positions, session._steps = 0, 33, 0
    session.flowing, session.pushing, session.audited, session._distrust_epoch = False, True, False, 0
    session.hops = [Hop(ChainLink(peer, start, end), InferenceStream(None, peer, start, end, 1.0, channels))
                    for peer, start, end in (("A", 0, 2), ("B", 2, 4))]
    return session


@pytest.fixture
def client(monkeypatch):
    """(model, services, channels, counts) on a client event loop of its own thread; counts: its tasks and the
    hand-offs to it from other threads."""
    monkeypatch.setattr(step_channel, "_StepStream", AnsweringStream)
    REFUSALS.clear()
    loop, counts = asyncio.new_event_loop(), {"tasks": 0, "handoffs": 0, "callbacks": 0}
    threadsafe, soon = loop.call_soon_threadsafe, loop.call_soon
    loop.call_soon_threadsafe = lambda *args: counts.__setitem__("handoffs", counts["handoffs"] + 1) or threadsafe(
        *args)
    # every wake-up of a task or future callback goes through call_soon
    loop.call_soon = lambda *args, **kwargs: counts.__setitem__("callbacks", counts["callbacks"] + 1) or soon(
        *args, **kwargs)
    loop.set_task_factory(lambda loop, coro, **kwargs: counts.__setitem__("tasks", counts["tasks"] + 1)
                          or asyncio.Task(coro, loop=loop, **kwargs))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    observed = []
    services = SimpleNamespace(wire_dtype=torch.float32, step_timeout=5.0, spot_checks=SimpleNamespace(rate=0.0),
                               bans=SimpleNamespace(distrust_epoch=0), audits=SimpleNamespace(rate=0.0),
                               load=SimpleNamespace(observed=lambda *args: observed.append(args)))
    model = RemoteModel.__new__(RemoteModel)
    model.client = SimpleNamespace(loop=SimpleNamespace(loop=loop))
    yield model, services, StepChannels(None, 1.0), counts, observed
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def run_tick(model, sessions) -> dict:
    """One tick's steps of every session (its index as its inputs) through start_steps: each one's (outputs, error)."""
    done, finished = {}, threading.Event()

    def on_done(key, outputs, error):
        done[key] = (outputs, error)
        if len(done) == len(sessions):
            finished.set()

    steps = [(index, SimpleNamespace(blocks=session), torch.full((1, 1, HIDDEN), float(index)), session.position)
             for index, session in enumerate(sessions)]
    model.start_steps(steps, on_done)
    assert finished.wait(10)
    return done


@pytest.mark.parametrize("count", [1, 64])
def test_a_ticks_steps_on_one_chain_cost_one_hand_off_one_task_and_one_message_a_hop(client, count):
    model, services, channels, counts, observed = client
    sessions = [session_on(services, channels) for _ in range(count)]
    done = run_tick(model, sessions)
    assert (counts["tasks"], counts["handoffs"]) == (1, 1)  # one wake-up of the client's loop, one task
    assert {peer: (channels.get(peer).messages_sent, channels.get(peer).steps_sent) for peer in ADDS} == {
        "A": (1, count), "B": (1, count)}
    for index, (outputs, error) in done.items():
        assert error is None and outputs.shape == (1, 1, HIDDEN) and float(outputs[0, 0, 0]) == index + 11.0
    for index, session in enumerate(sessions):  # each session's own part: its position, its hops' records
        assert session.position == 1 and session.step_id == 1
        assert float(session.hops[1].inputs[0, 0, 0]) == index + 1.0  # kept for a replay onto a replacement
    assert [(peer, blocks) for peer, _, blocks in observed] == [("A", 2), ("B", 2)]  # routing learns each hop once


def test_a_step_refused_at_a_hop_goes_on_alone_and_the_others_are_not_held_up(client):
    model, services, channels, counts, _ = client
    sessions = [session_on(services, channels) for _ in range(8)]
    failing, wrong = sessions[3], sessions[5]
    REFUSALS["A", failing.hops[0].stream.session_id] = ServerUnavailableError("gone")
    REFUSALS["B", wrong.hops[1].stream.session_id] = BadRequestError("field 'position' is wrong")
    fail_overs = []

    def fail_over(index, error, new_positions):  # a replacement of A's blocks that answers as A did
        fail_overs.append((index, type(error), new_positions))
        return failing.hops[0].inputs + ADDS["A"], index + 1

    failing._fail_over = fail_over
    done = run_tick(model, sessions)
    assert fail_overs == [(0, ServerUnavailableError, 1)]
    assert float(done[3][0][0, 0, 0]) == 3 + 11.0 and done[3][1] is None  # failed over: the same outputs
    assert done[5][0] is None and isinstance(done[5][1], BadRequestError)  # its own error is its step's
    for index in (0, 1, 2, 4, 6, 7):
        assert done[index][1] is None and float(done[index][0][0, 0, 0]) == index + 11.0
    assert counts["tasks"] == 3  # the convoy, and one for each step that left it
    assert channels.get("B").messages_sent == 2  # the convoy's, then the failed-over step's own


@pytest.mark.parametrize("particular", ["flowing", "spot_checked", "distrusting"])
def test_a_step_with_something_of_its_own_runs_alone(client, particular):
    model, services, channels, counts, _ = client
    sessions = [session_on(services, channels) for _ in range(4)]
    special = sessions[0]
    if particular == "flowing":
        special.flowing = True
        special.flow_grace = 1.0
    elif particular == "spot_checked":
        special.services = SimpleNamespace(**{**vars(services), "spot_checks": SimpleNamespace(rate=1.0)})
    else:
        special._distrust_epoch = -1
    step = special.begin_step(torch.zeros(1, 1, HIDDEN))
    assert not special.relays_plainly(step)
    assert all(session.relays_plainly(session.begin_step(torch.zeros(1, 1, HIDDEN))) for session in sessions[1:])


def test_a_ticks_wake_ups_of_the_event_loop_do_not_grow_with_its_sessions(client):
    """Each callback the client's loop runs (a task's step, a future's callback, a flush) goes through call_soon: a
    tick of 64 sessions on one chain costs as many as a tick of one (a step each used to cost two per hop)."""
    model, services, channels, counts, _ = client
    callbacks = []
    for count in (1, 64):
        counts["callbacks"] = 0
        run_tick(model, [session_on(services, channels) for _ in range(count)])
        callbacks.append(counts["callbacks"])
    assert callbacks[1] == callbacks[0], callbacks
