"""Flowing steps: a session's step sent once to each server of its chain, with its inputs only to the first.

Relayed, a step goes to the first server, comes back, goes to the second, and so on: n round trips for n
servers. Flowing, the client sends every server its step at once; the first gets the inputs, each of the others
a flowing step of no tensor (InferenceStream.flowing_step) that waits for the inputs pushed by the previous
server (swarm/server/pushes.py's awaited_push), computes them and pushes its outputs on. The last server's
answer ends the step: about (n + 1) / 2 round trips. Every server still answers the client with its outputs,
which come in while the step flows on: they are the next server's inputs, kept to replay a hop on failover.

A push lost (a server that does not push, a push refused or dropped) costs a round trip, not the session: when
a server's outputs have reached the client and the next server has not answered within `grace` seconds (or
answered NoPushError: its `push_wait` passed, or the push was not what the step declared), the client sends it
the inputs itself, as a relayed step; the server's flowing step then ends, superseded. A failover ends the flow:
the rest of the step is relayed.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Optional

import torch

from swarm.client.stubs import checked_outputs
from swarm.protocol import CacheFullError, InternalServerError, ServerUnavailableError

if TYPE_CHECKING:
    from swarm.client.remote_session import Hop

# seconds the next server has to answer from its push, once the previous one's outputs reached the client,
# before the client sends them itself: a push leaves its server as the outputs do, so it is late past a
# network's jitter and a step's compute
FLOW_GRACE = 1.0
# faults of the server itself, which fail the hop over (any other answer to a flowing step, NoPushError above
# all, is answered by sending the inputs)
HOP_FAULTS = (ServerUnavailableError, InternalServerError, CacheFullError)


def flowing_by_default() -> bool:
    """Sessions flow their steps where the FLOWING_STEPS setting is 1 (RemoteSession.flowing says per session)."""
    return os.environ.get("FLOWING_STEPS", "0").strip() == "1"


class Flow:
    """One step's flowing steps, sent at once to every server of the chain after the first whose previous
    server pushes to it (the step's positions within what was declared to it)."""

    def __init__(self, session, hidden: torch.Tensor, position: int, timeout: float, grace: float = FLOW_GRACE):
        self.session, self.grace = session, grace
        self._waiting: dict[int, asyncio.Task] = {}  # by id(hop): each hop's flowing step
        hops, length = session.hops, hidden.shape[1]
        for index in range(1, len(hops)):
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

    def flows_to(self, hop: "Hop") -> bool:
        return id(hop) in self._waiting

    async def output(self, hop: "Hop", hidden: torch.Tensor, position: int,
                     following: Optional["Hop"]) -> torch.Tensor:
        """The hop's outputs for `hidden` (the previous hop's, as it answered the client): from its flowing step,
        or, where no push came in time, from a relayed step of those inputs."""
        task = self._waiting.pop(id(hop))
        await asyncio.wait({task}, timeout=self.grace)
        if task.done() and not task.cancelled():
            error = task.exception()
            if error is None:
                hop.declared = self.session.next_positions
                return checked_outputs(task.result(), hidden, hop.link.peer_id,
                                       f"blocks {hop.link.start}:{hop.link.end}")
            if isinstance(error, HOP_FAULTS):
                raise error
        self.session.pushes_missed += 1
        return await self.session._step_hop_async(hop, hidden, position, following)

    def abandon(self) -> None:
        """The step goes on relayed (a failover replaced a hop): the flowing steps left are given up on (their
        servers end them when the relayed copies come)."""
        for task in self._waiting.values():
            task.cancel()
        self._waiting.clear()


def _retrieved(task: asyncio.Task) -> None:
    """A flowing step's error is retrieved even where nobody awaits it (a hop given up on, a step failed over)."""
    if not task.cancelled():
        task.exception()
