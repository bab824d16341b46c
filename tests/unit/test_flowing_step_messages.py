"""Flowing steps without the network. The server's side (swarm/server/pushes.py's awaited_push): a step whose
entry awaits its inputs pushed by the previous server is answered by the pushed step's outputs, or with
NoPushError where no push came in time or the client's own copy came first. The client's side
(swarm/client/flowing.py): a step goes once to each hop, its inputs only to the first; a hop whose push is lost
is sent its inputs after the grace; a hop's fault fails it over."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from swarm.client.flowing import RELAYED_AFTER_LOST_PUSH
from swarm.client.peers import Bans
from swarm.protocol import PAGE_TOKENS, BadRequestError, NoPushError, ServerUnavailableError
from swarm.server.backend import Backend
from swarm.server.cache import CacheBudget
from swarm.wire import inputs_digest
from test_push_declared import HIDDEN, LIMITS, OPENING, SESSION, push, span  # noqa: F401 (span: a fixture)


def flowing(step_id: int, position: int, length: int = 1, wait: float = 5.0) -> dict:
    return {"session_id": SESSION, "step_id": step_id, "position": position, "await_push": True,
            "push_wait": wait, "rows": 1, "length": length, "next_positions": 1}


def server_run(span, scenario):
    async def body():
        backend = Backend(span, CacheBudget(16 * PAGE_TOKENS), LIMITS)
        try:
            relayed = await backend.open_session({**OPENING, "session_id": "r" * 32, "next_positions": 8}, "client")
            session = await backend.open_session({**OPENING, "next_positions": 8}, "client")
            await scenario(backend, session, relayed)
        finally:
            for session in list(backend.sessions):
                session.close()
            backend.close()

    asyncio.run(body())


def test_a_flowing_step_is_answered_by_its_push_with_a_relayed_steps_outputs(span):
    prompt = torch.randn(1, 5, HIDDEN)

    async def scenario(backend, session, relayed):
        waiting = asyncio.ensure_future(backend.run_steps([(session, None, flowing(1, 0, 5))]))
        await asyncio.sleep(0.05)  # the flowing step waits: the push comes after it
        assert not waiting.done()
        assert push(backend, prompt, 1, 0) is None
        [(output, pushed)] = await waiting
        assert torch.equal(pushed, prompt)  # what the server tells the client its push carried
        [expected] = await backend.run_steps([(relayed, prompt, {"position": 0, "step_id": 1})])
        assert torch.equal(output, expected)
        assert session.length == 5 and backend.sessions.steps_pushed == 1
        # the push came first this time: answered at once
        decode = torch.randn(1, 1, HIDDEN)
        assert push(backend, decode, 2, 5) is None
        [(output, _)] = await backend.run_steps([(session, None, flowing(2, 5))])
        [expected] = await backend.run_steps([(relayed, decode, {"position": 5, "step_id": 2})])
        assert torch.equal(output, expected) and session.length == 6

    server_run(span, scenario)


def test_a_flowing_step_whose_push_never_comes_answers_no_push_and_the_clients_copy_runs(span):
    prompt = torch.randn(1, 5, HIDDEN)

    async def scenario(backend, session, relayed):
        [answer] = await backend.run_steps([(session, None, flowing(1, 0, 5, wait=0.1))])
        assert isinstance(answer, NoPushError)
        # waiting again, until the client's own copy comes: that supersedes it at once
        waiting = asyncio.ensure_future(backend.run_steps([(session, None, flowing(1, 0, 5))]))
        await asyncio.sleep(0.05)
        [output] = await backend.run_steps([(session, prompt, {"position": 0, "step_id": 1})])
        [answer] = await asyncio.wait_for(waiting, 1.0)
        assert isinstance(answer, NoPushError)
        [expected] = await backend.run_steps([(relayed, prompt, {"position": 0, "step_id": 1})])
        assert torch.equal(output, expected) and session.length == 5
        [refusal] = await backend.run_steps([(session, None, flowing(2, 5, wait=-1))])
        assert isinstance(refusal, BadRequestError) and "push_wait" in str(refusal)

    server_run(span, scenario)


def test_the_clients_copy_of_a_step_a_flowing_step_is_computing_waits_for_it_and_shares_its_outputs(span):
    """The grace ran out (a loaded server) while the flowing step was computing from its push: the client's copy
    of the same step waits for that computation, not refused as a second step of the session at once."""
    prompt = torch.randn(1, 5, HIDDEN)

    async def scenario(backend, session, relayed):
        computed, settle = asyncio.Event(), session.early_settled

        async def settled_when_told(early, result):
            await computed.wait()
            settle(early, result)

        # the pushed step's computation ends when the test says (a loaded server's compute thread)
        session.early_settled = lambda early, result: asyncio.ensure_future(settled_when_told(early, result))
        waiting = asyncio.ensure_future(backend.run_steps([(session, None, flowing(1, 0, 5))]))
        await asyncio.sleep(0.05)
        assert push(backend, prompt, 1, 0) is None
        await asyncio.sleep(0.05)
        assert session.early_step(1) is None and session.busy  # the flowing step took it, still computing
        copy = asyncio.ensure_future(backend.run_steps([(session, prompt, {"position": 0, "step_id": 1})]))
        await asyncio.sleep(0.05)
        computed.set()
        [output] = await copy
        [(flowed, _)] = await waiting
        [expected] = await backend.run_steps([(relayed, prompt, {"position": 0, "step_id": 1})])
        assert torch.equal(output, expected) and torch.equal(flowed, expected)
        assert session.length == 5 and backend.sessions.positions_served == 10  # computed once, and the relayed

    server_run(span, scenario)


class Stream:
    """A fake server of one block: outputs = inputs + its index; flowing steps answered as told."""

    def __init__(self, index: int, flowing_answer: str = "push"):
        self.index, self.flowing_answer, self.calls = index, flowing_answer, []
        self.pushed: asyncio.Future = None
        self.name = f"server{index}"

    async def step(self, hidden, position, timeout, step_id, push_to, next_positions, group=0):
        self.calls.append(("step", hidden.shape[1]))
        return await self._computed(hidden, push_to)

    async def flowing_step(self, shape, position, push_wait, timeout, step_id, push_to, next_positions):
        self.calls.append(("flowing", shape[1]))
        if self.flowing_answer == "never":
            await asyncio.sleep(60)
        if self.flowing_answer == "no_push":
            raise NoPushError("no push came")
        if self.flowing_answer == "fault":
            raise ServerUnavailableError("gone")
        pushed = await self.pushed
        if self.flowing_answer == "late":  # its push works, but its answer comes after the grace
            await asyncio.sleep(0.2)
        return await self._computed(pushed, push_to), inputs_digest(pushed)

    async def _computed(self, hidden, push_to):
        output = hidden + self.index
        if self.flowing_answer == "lying pusher":  # returns its outputs, pushes others
            hidden, output = output, output + 100
        if push_to is not None and push_to.pushed is not None and not push_to.pushed.done():
            push_to.pushed.set_result(output)
        return hidden if self.flowing_answer == "lying pusher" else output


def client_session(streams, grace=5.0):
    from swarm.client.remote_session import Hop, RemoteSession
    from swarm.client.routing import ChainLink

    session = RemoteSession.__new__(RemoteSession)  # its chain by hand: no network
    session.services = SimpleNamespace(wire_dtype=torch.float32, spot_checks=SimpleNamespace(rate=0), bans=Bans(),
                                       step_timeout=5.0, load=SimpleNamespace(observed=lambda *args: None))
    session.max_length, session.position, session._steps, session.next_positions = 100, 0, 0, 8
    session.flowing, session.flow_grace = True, grace
    session.hops = [Hop(ChainLink(stream.name, index, index + 1), stream, declared=8)
                    for index, stream in enumerate(streams)]
    return session


def flowing_step(streams, grace=5.0):
    session = client_session(streams, grace)

    async def scenario():
        for stream in streams:
            stream.pushed = asyncio.get_running_loop().create_future()
        return await session.step_async(torch.zeros(1, 2, HIDDEN))

    return asyncio.run(scenario()), session


def test_a_flowing_step_goes_once_to_each_hop_with_inputs_only_to_the_first():
    streams = [Stream(index) for index in range(3)]
    output, session = flowing_step(streams)
    assert torch.equal(output, torch.full((1, 2, HIDDEN), 3.0))
    assert [stream.calls for stream in streams] == [[("step", 2)], [("flowing", 2)], [("flowing", 2)]]
    assert torch.equal(session.hops[2].inputs, torch.full((1, 2, HIDDEN), 1.0))  # kept for a replay
    assert session.pushes_missed == 0


def test_every_hop_of_a_flowing_decode_step_tells_routing_its_time():
    """Routing's compute per block of a server comes from the steps through it: mid-chain servers of flowing
    steps are measured too (by their answers' lag), not only the first, which alone gets its inputs."""
    streams = [Stream(index) for index in range(3)]
    session, observed = client_session(streams), []
    session.services.load = SimpleNamespace(observed=lambda peer, seconds, blocks: observed.append((peer, blocks)))

    async def scenario():
        for stream in streams:
            stream.pushed = asyncio.get_running_loop().create_future()
        return await session.step_async(torch.zeros(1, 1, HIDDEN))

    asyncio.run(scenario())
    assert [stream.calls for stream in streams] == [[("step", 1)], [("flowing", 1)], [("flowing", 1)]]
    assert sorted(observed) == [("server0", 1), ("server1", 1), ("server2", 1)]


@pytest.mark.parametrize("answer", ["never", "no_push"])
def test_a_hop_whose_push_is_lost_is_sent_its_inputs(answer):
    streams = [Stream(0), Stream(1, answer), Stream(2)]
    output, session = flowing_step(streams, grace=0.05)
    assert torch.equal(output, torch.full((1, 2, HIDDEN), 3.0))
    assert streams[1].calls == [("flowing", 2), ("step", 2)]
    assert session.pushes_missed == 1

    async def next_step():  # relayed to the hop that lost its push, flowing to the others
        for stream in streams:
            stream.calls, stream.pushed = [], asyncio.get_running_loop().create_future()
        return await session.step_async(torch.zeros(1, 2, HIDDEN))

    assert torch.equal(asyncio.run(next_step()), torch.full((1, 2, HIDDEN), 3.0))
    assert [stream.calls for stream in streams] == [[("step", 2)], [("step", 2)], [("flowing", 2)]]
    assert session.hops[1].relayed_steps == RELAYED_AFTER_LOST_PUSH - 1


def test_each_push_lost_in_a_row_doubles_the_steps_relayed_before_the_next_try():
    from swarm.client.flowing import MOST_DOUBLINGS

    streams = [Stream(0), Stream(1, "no_push"), Stream(2)]
    session, hop = client_session(streams), None

    async def tries(count):
        relayed = []
        for _ in range(count):
            hop.relayed_steps = 0  # its relayed steps done: the next step flows to it again
            for stream in streams:
                stream.pushed = asyncio.get_running_loop().create_future()
            await session.step_async(torch.zeros(1, 2, HIDDEN))
            relayed.append(hop.relayed_steps)
        return relayed

    hop = session.hops[1]
    assert asyncio.run(tries(MOST_DOUBLINGS + 2)) == [RELAYED_AFTER_LOST_PUSH << min(tried, MOST_DOUBLINGS)
                                                      for tried in range(MOST_DOUBLINGS + 2)]
    streams[1].flowing_answer = "push"  # it takes pushes again: one flowing answer starts the count over
    asyncio.run(tries(1))
    streams[1].flowing_answer = "no_push"
    assert asyncio.run(tries(1)) == [RELAYED_AFTER_LOST_PUSH]


def test_a_late_flowing_answer_counts_and_the_hop_flows_again_at_once():
    streams = [Stream(0), Stream(1, "late"), Stream(2)]
    session = client_session(streams, grace=0.05)

    async def steps():
        for stream in streams:
            stream.pushed = asyncio.get_running_loop().create_future()
        first = await session.step_async(torch.zeros(1, 2, HIDDEN))
        await asyncio.sleep(0.3)  # the late answer comes
        return first

    assert torch.equal(asyncio.run(steps()), torch.full((1, 2, HIDDEN), 3.0))
    assert streams[1].calls == [("flowing", 2), ("step", 2)] and session.pushes_missed == 1
    hop = session.hops[1]
    assert hop.relayed_steps == 0 and hop.flow_lag >= 0.2  # it flows again, with a grace that waits for it
    assert hop.flow_grace(5.0, session.hops) >= 0.8


def test_a_hops_grace_is_a_few_times_its_lag_within_bounds():
    from swarm.client.hops import FLOW_GRACE_LAGS, MIN_FLOW_GRACE

    hops = client_session([Stream(index) for index in range(3)]).hops
    assert hops[1].flow_grace(1.0, hops) == 1.0  # nothing flowed yet: the most
    hops[1].flowed(0.02)
    assert hops[1].flow_grace(1.0, hops) == pytest.approx(FLOW_GRACE_LAGS * 0.02)
    assert hops[2].flow_grace(1.0, hops) == pytest.approx(FLOW_GRACE_LAGS * 0.02)  # a newcomer: its chain's lag
    hops[2].flowed(0.001)
    assert hops[2].flow_grace(1.0, hops) == MIN_FLOW_GRACE
    hops[1].flowed(10.0)  # slower at once: counted at once
    assert hops[1].flow_grace(1.0, hops) == 1.0
    hops[1].flowed(0.0)  # faster: counted gradually
    assert hops[1].flow_lag == pytest.approx(8.0)


def test_a_push_other_than_the_previous_servers_outputs_is_not_used():
    streams = [Stream(0, "lying pusher"), Stream(1), Stream(2)]
    output, session = flowing_step(streams)
    assert torch.equal(output, torch.full((1, 2, HIDDEN), 3.0))  # from the outputs server 0 returned
    # the second server computed the wrong push, and pushed its outputs on: both are sent their inputs
    assert streams[1].calls == streams[2].calls == [("flowing", 2), ("step", 2)]
    assert session.pushes_missed == 2


def test_a_hop_at_fault_in_a_flowing_step_fails_over(monkeypatch):
    from swarm.client.remote_session import RemoteSession

    streams = [Stream(0), Stream(1, "fault"), Stream(2)]
    failed = []

    def fail_over(self, index, error, positions):
        failed.append((index, type(error)))
        raise RuntimeError("failed over")

    monkeypatch.setattr(RemoteSession, "_fail_over", fail_over)
    with pytest.raises(RuntimeError, match="failed over"):
        flowing_step(streams)
    assert failed == [(1, ServerUnavailableError)]


def test_sessions_flow_their_steps_where_it_pays_unless_the_setting_says_always_or_never(monkeypatch):
    from swarm.client.flowing import flowing_by_default

    monkeypatch.delenv("FLOWING_STEPS", raising=False)
    assert flowing_by_default() is None
    for value, expected in (("0", False), ("1", True), ("auto", None)):
        monkeypatch.setenv("FLOWING_STEPS", value)
        assert flowing_by_default() is expected


@pytest.mark.parametrize("round_trip, flows", [(0.001, False), (0.050, True), (None, True)])
def test_by_default_steps_flow_only_where_a_later_server_is_far(round_trip, flows):
    """On one machine or a LAN a flowing step's extra messages cost more than the round trips it saves: relayed
    there; a server far from the client, or not measured yet, is flowed to. A step reads its own servers' round
    trips only (the load has no `round_trips` here: a copy of every server's, per step, in a swarm of thousands)."""
    streams = [Stream(index) for index in range(3)]
    session = client_session(streams)
    session.flowing = None
    measured = {} if round_trip is None else {stream.name: round_trip for stream in streams}
    session.services.load = SimpleNamespace(observed=lambda *args: None, round_trip_to=measured.get)

    async def scenario():
        for stream in streams:
            stream.pushed = asyncio.get_running_loop().create_future()
        return await session.step_async(torch.zeros(1, 2, HIDDEN))

    assert torch.equal(asyncio.run(scenario()), torch.full((1, 2, HIDDEN), 3.0))
    assert streams[2].calls == ([("flowing", 2)] if flows else [("step", 2)])
