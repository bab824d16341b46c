"""Convoys: the steps of the sessions that share a chain, moved through it together (the gateway's engine loop
starts a tick's steps this way: swarm/client/remote_model.py's start_steps).

The steps bound for one server travel in one message anyway (swarm/client/step_channel.py); what a session's step
cost the client's event loop besides was a task of its own and, per hop, a future and a wake-up: at 64 sessions on
two servers, 64 tasks, 128 futures and 128 wake-ups a tick. A convoy is one task for the steps of every session
whose chain is the same servers and whose group is the same, and per hop one future for all of them
(StepChannel.step_many); each session's own part of a hop (its record for a replay, its entry, the check of its
outputs) is the same as when it steps alone (RemoteSession).

What is particular to a session's step goes its own way, as before: a step with a spot check, a flowing step, or
one whose session must first leave a server caught lying runs alone (RemoteSession.run_step); a step that fails at a
hop (a server at fault, a full cache, an error of its own) leaves the convoy there and goes on alone from that hop,
failing over as always (RemoteSession.go_on), while the others go on without it.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Coroutine, Sequence

import torch

from swarm.client.remote_session import RemoteSession, StepState
from swarm.client.stage_clock import CLOCK, now

# on_done(key, outputs, error): a step's end, told once, on the client's event loop
OnDone = Callable[[object, "torch.Tensor | None", "BaseException | None"], None]
_RUNNING: set[asyncio.Task] = set()  # convoys and lone steps under way (asyncio keeps only weak references to tasks)


@dataclass
class _Member:
    key: object  # the caller's name for the step
    session: RemoteSession
    step: StepState


def start_steps(steps: Sequence[tuple[object, RemoteSession, torch.Tensor, int]], on_done: OnDone,
                started: float) -> None:
    """Start each (key, session, hidden (1, length, hidden), position): the plain steps of sessions whose chain and
    group are the same as a convoy each, any other step alone. Runs on the client's event loop."""
    convoys: dict[tuple, list[_Member]] = defaultdict(list)
    for key, session, hidden, position in steps:
        try:
            step = session.begin_step(hidden, position)
        except Exception as error:  # past its max_length, or a session closed meanwhile: the others go on
            on_done(key, None, error)
            continue
        if session.relays_plainly(step):
            chain = tuple(hop.link.peer_id for hop in session.hops)
            convoys[session.group, chain].append(_Member(key, session, step))
        else:
            _alone(session.run_step(step), key, on_done, started)
    for members in convoys.values():
        _start(_convoy(members, on_done, started))


async def _convoy(members: list[_Member], on_done: OnDone, started: float) -> None:
    """The members' steps through their chain, hop by hop; each told its end as it ends."""
    live, index = members, 0
    try:
        while live and index < len(live[0].session.hops):
            live = await _hop(live, index, on_done, started)
            index += 1
        CLOCK.add("client_step", now() - started, len(live))
        # every end told in one go, with no torch call between them (one lets the engine's thread in, which would
        # then take the steps ended so far as a tick of their own)
        ended = [(member.key, member.session.end_step(member.step)) for member in live]
        for key, outputs in ended:
            on_done(key, outputs, None)
    except BaseException as error:  # a bug, or the loop shutting down: no step is left waiting for its end
        for member in live:
            on_done(member.key, None, error)
        raise


async def _hop(members: list[_Member], index: int, on_done: OnDone, started: float) -> list[_Member]:
    """Hop `index` of every member's step, in one call to its server's step channel; the members that go on."""
    hops, hiddens, entries, timeouts = [], [], [], []
    for member in members:
        session, step = member.session, member.step
        hop = session.hops[index]
        hop.record(step.output, step.position)
        following = session.following(index, step.output.shape[1], session.pushing)
        hops.append(hop)
        hiddens.append(step.output)
        entries.append(hop.stream.step_entry(step.position, session.step_id,
                                             following.stream if following is not None else None,
                                             session.next_positions))
        timeouts.append(step.timeout)
    link, stream = hops[0].link, hops[0].stream
    began = time.perf_counter()
    outcomes = await stream.channels.get(link.peer_id).step_many(hiddens, entries, timeouts,
                                                                 f"blocks {link.start}:{link.end}",
                                                                 members[0].session.group)
    elapsed, going_on = time.perf_counter() - began, []
    for member, hop, outcome in zip(members, hops, outcomes):
        session, step = member.session, member.step
        try:
            session.answered(hop, step, session.hop_outputs(hop, step.output, outcome))
            going_on.append(member)
        except Exception as fault:  # it goes on alone from this hop: a failover, or its own error
            _alone(session.go_on(step, index, fault), member.key, on_done, started)
    if going_on and all(hidden.shape[1] == 1 for hidden in hiddens):  # decode steps: what routing compares by
        members[0].session.services.load.observed(link.peer_id, elapsed, link.end - link.start)
    return going_on


def _alone(step: Coroutine, key: object, on_done: OnDone, started: float) -> None:
    """One session's step as a task of its own, its end told to on_done."""
    task = _start(step)
    task.add_done_callback(lambda task: _ended_alone(task, key, on_done, started))


def _ended_alone(task: asyncio.Task, key: object, on_done: OnDone, started: float) -> None:
    CLOCK.add("client_step", now() - started)
    error = task.exception() if not task.cancelled() else asyncio.CancelledError()
    on_done(key, None if error is not None else task.result(), error)


def _start(step: Coroutine) -> asyncio.Task:
    task = asyncio.ensure_future(step)
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    return task
