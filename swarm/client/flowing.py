"""Flowing steps: a session's step sent once to each server of its chain, with its inputs only to the first.

Relayed, a step goes to the first server, comes back, goes to the second, and so on: n round trips for n
servers. Flowing, the client sends every server its step at once; the first gets the inputs, each of the others
a flowing step of no tensor (InferenceStream.flowing_step) that waits for the inputs pushed by the previous
server (swarm/server/pushes.py's awaited_push), computes them and pushes its outputs on. The last server's
answer ends the step: about (n + 1) / 2 round trips. Every server still answers the client with its outputs,
which come in while the step flows on: they are the next server's inputs, kept to replay a hop on failover.

A push lost (a server that does not push, a push refused or dropped) costs a round trip, not the session: when
a server's outputs have reached the client and the next server has not answered within its grace (or answered
NoPushError: its `push_wait` passed, or the push was not what the step declared), the client sends it the inputs
itself, as a relayed step; the server's flowing step then ends, superseded (or, computing from a push already,
answers both). A failover ends the flow: the rest of the step is relayed.

A hop's grace follows what its flowing answers took (Hop.flow_grace): a few times their lag behind the previous
hop's outputs, so that a lost push costs about a step, not a fixed second. A server whose push was lost is
relayed to for the next RELAYED_AFTER_LOST_PUSH steps (twice as many for each push lost in a row), unless its
flowing answer comes after all (only late).

A server answers a flowing step with what its push carried (a digest): where it is not the previous server's
outputs as they came to the client (a server that pushes otherwise than it returns), the client sends the inputs
itself, and that copy, rewinding the step, is what counts, as with relayed steps.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Optional

import torch

from swarm.client.hops import Hop
from swarm.client.step_channel import MULTIPLEX_MAX_POSITIONS
from swarm.client.stubs import checked_outputs
from swarm.protocol import CacheFullError, InternalServerError, ServerUnavailableError
from swarm.wire import inputs_digest

# the most seconds the next server has to answer from its push, once the previous one's outputs reached the
# client, before the client sends them itself (until a hop's lag is known, it has this long): a push leaves
# its server as the outputs do, so it is late past a network's jitter and a step's compute
FLOW_GRACE = 1.0
# steps relayed to a server after a push to it was lost, before the next flowing one: a server that never takes
# pushes from the previous one (a private server, or one whose previous server does not find it announced) costs
# a grace every this many steps, not every step
RELAYED_AFTER_LOST_PUSH = 16
# each push lost in a row (between them, only relayed steps) doubles that, up to this many times: a server that
# can never take the previous one's pushes (behind a NAT from it, say) costs a grace every 1,024 steps at most
MOST_DOUBLINGS = 6
# below this round trip to every server after the first, steps are relayed where FLOWING_STEPS is unset: on
# loopback (tiny model, 2 cores) one session took 3.7 ms a token flowing against 1.7 relayed, and 64 sessions
# 1,680 against 1,966 tok/s; flowing saves (hops - 1) / 2 round trips a step
FLOW_MIN_ROUND_TRIP = 0.005
# faults of the server itself, which fail the hop over (any other answer to a flowing step, NoPushError above
# all, is answered by sending the inputs)
HOP_FAULTS = (ServerUnavailableError, InternalServerError, CacheFullError)


def flowing_by_default() -> Optional[bool]:
    """The FLOWING_STEPS setting: sessions flow their steps always (True), never (False), or where it pays (None,
    the default: see flow_pays); RemoteSession.flowing says per session."""
    from config import said

    return said("FLOWING_STEPS")


class Flow:
    """One step's flowing steps, sent at once to every server of the chain after the first whose previous
    server pushes to it (the step's positions within what was declared to it)."""

    def __init__(self, session, hidden: torch.Tensor, position: int, timeout: float, grace: float = FLOW_GRACE):
        self.session, self.grace = session, grace
        self._waiting: dict[int, asyncio.Task] = {}  # by id(hop): each hop's flowing step
        hops, length = session.hops, hidden.shape[1]
        for index in range(1, len(hops)):
            if hops[index].relayed_steps > 0:  # a push to it was lost lately: it may never take any
                hops[index].relayed_steps -= 1
                continue
            if hops[index].declared < length:  # its previous server would not compute a push of it
                continue
            following = hops[index + 1] if index + 1 < len(hops) and hops[index + 1].declared >= length else None
            push_wait = timeout * index  # the servers before it compute first
            step = hops[index].stream.flowing_step(
                (hidden.shape[0], length), position, push_wait, push_wait + timeout, session.step_id,
                following.stream if following is not None else None, session.next_positions)
            task = asyncio.ensure_future(step)
            task.add_done_callback(_retrieved)
            self._waiting[id(hops[index])] = task

    @staticmethod
    def wanted(session, hidden: torch.Tensor) -> bool:
        """Whether the step flows: the session flows its steps (or, by default, where it pays), and it is short."""
        if session.flowing is False or len(session.hops) < 2 or hidden.shape[1] > MULTIPLEX_MAX_POSITIONS:
            return False
        return session.flowing is not None or flow_pays(session.hops, session.services.load.round_trip_to)

    @classmethod
    def of_step(cls, session, hidden: torch.Tensor, position: int, timeout: float) -> Optional["Flow"]:
        """The step's flow, where it flows (its flowing steps sent at once); else None (relayed)."""
        return cls(session, hidden, position, timeout, session.flow_grace) if cls.wanted(session, hidden) else None

    def flows_to(self, hop: "Hop") -> bool:
        return id(hop) in self._waiting

    async def output(self, hop: "Hop", hidden: torch.Tensor, position: int,
                     following: Optional["Hop"]) -> torch.Tensor:
        """The hop's outputs for `hidden` (the previous hop's, as it answered the client): from its flowing step,
        or, where no push came in time, from a relayed step of those inputs."""
        task, began = self._waiting.pop(id(hop)), time.monotonic()
        await asyncio.wait({task}, timeout=hop.flow_grace(self.grace, self.session.hops))
        if task.done() and not task.cancelled():
            error = task.exception()
            output, pushed = task.result() if error is None else (None, None)
            if error is None and pushed == inputs_digest(hidden):
                self._measured(hop, time.monotonic() - began, hidden.shape[1])
                hop.declared = self.session.next_positions
                return checked_outputs(output, hidden, hop.link.peer_id, f"blocks {hop.link.start}:{hop.link.end}",
                                       finite=True)
            if isinstance(error, HOP_FAULTS):
                raise error
        self.session.pushes_missed += 1
        hop.relayed_steps = RELAYED_AFTER_LOST_PUSH << min(hop.pushes_lost_in_a_row, MOST_DOUBLINGS)
        hop.pushes_lost_in_a_row += 1
        if not task.done():  # a late answer from its push tells the push works: the hop flows again at once
            task.add_done_callback(lambda late: _late_answer(late, hop, began, inputs_digest(hidden)))
        return await self.session._step_hop_async(hop, hidden, position, following)

    def _measured(self, hop: "Hop", lag: float, positions: int) -> None:
        """What routing learns of a hop's server from a flowing answer: its lag behind the previous hop's outputs
        is, where links cost each server's distance to the client (a push from the previous server, then the
        answer), the server's round trip plus its compute; so it counts as a relayed step's time does."""
        hop.flowed(lag)
        if positions == 1:  # a decode step: what routing compares servers by
            self.session.services.load.observed(hop.link.peer_id, lag, hop.link.end - hop.link.start)

    def abandon(self) -> None:
        """The step goes on relayed (a failover replaced a hop): the flowing steps left are given up on (their
        servers end them when the relayed copies come)."""
        for task in self._waiting.values():
            task.cancel()
        self._waiting.clear()


def flow_pays(hops: list["Hop"], round_trip_to: Callable[[str], Optional[float]]) -> bool:
    """Whether a server after the first is far enough from the client (its measured round trip; one not measured
    yet counts as far) that flowing saves more than it costs: a flowing step sends more messages (the pushes, and
    every server's own answer), which on a LAN or one machine cost more than the round trips saved."""
    for hop in hops[1:]:  # asked each step: the round trips of the chain's own servers, never a copy of all
        round_trip = round_trip_to(hop.link.peer_id)
        if round_trip is None or round_trip >= FLOW_MIN_ROUND_TRIP:
            return True
    return False


def _late_answer(task: asyncio.Task, hop: "Hop", began: float, expected: bytes) -> None:
    """A flowing answer that came after its grace: where it is what the push should have carried, the push works
    but took longer than the grace allowed; its lag counts, and the hop is no longer relayed to."""
    if task.cancelled() or task.exception() is not None or task.result()[1] != expected:
        return
    hop.flowed(time.monotonic() - began)
    hop.relayed_steps = hop.pushes_lost_in_a_row = 0


def _retrieved(task: asyncio.Task) -> None:
    """A flowing step's error is retrieved even where nobody awaits it (a hop given up on, a step failed over)."""
    if not task.cancelled():
        task.exception()
