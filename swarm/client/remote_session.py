"""A remote inference session: hidden states through a chain of block servers that keep its cache, surviving
their failures (ban, re-route, replay)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Collection, Optional

import torch

from swarm.client import metrics
from swarm.client.chain_opening import SERVER_FAULTS, open_hops
from swarm.client.flowing import FLOW_GRACE, Flow, flowing_by_default
from swarm.client.hops import Hop, pushing_by_default
from swarm.client.routing import ChainLink
from swarm.client.services import ClientServices, Route
from swarm.client.spot_check import LIAR_BAN_SECONDS
from swarm.client.step_channel import NEXT_STEP_POSITIONS
from swarm.client.stubs import STEP_SECONDS_PER_TOKEN, InferenceStream, MalformedOutputsError, checked_outputs
from swarm.protocol import CacheFullError, MissingBlocksError, SessionClosedError, SessionLengthError

logger = logging.getLogger(__name__)


@dataclass
class StepState:
    """A step on its way through the chain: the inputs of the next hop (at first the session's, in the wire's
    dtype), where it starts and ends, each hop's timeout, and what it returns its outputs as."""

    output: torch.Tensor
    position: int
    end: int
    timeout: float
    dtype: torch.dtype
    check: Optional[object] = None  # its spot check (swarm/client/spot_check.py), if it has one
    flow: Optional[Flow] = None  # its flow (swarm/client/flowing.py), if it flows


class RemoteSession:
    """Hidden states of new positions in, outputs of the last block out; each server keeps its cache.

    When a server fails (dies, stalls, is cut off), the session bans it, finds other servers for its blocks,
    replays the inputs that server had received so that the new ones rebuild their caches, and goes on: the outputs
    are the same as without the failure. Retries are bounded, with backoff. When no server holds some of its blocks,
    it waits up to the client's block_wait for one (SwarmClient.wait_for_chain), telling `on_wait(message)`, if set.

    With `pushing` (PUSHED_STEPS, on by default), each server pushes a step's outputs on to the next, which starts
    at once, within the positions the session declared its next step there may carry (`next_positions`, at the
    opening and in each step: a short step by default). With `flowing` (True, or None: where the chain's round
    trips make it pay), a short step goes to every server at once, its inputs only to the first, and flows down the
    chain by the pushes (swarm/client/flowing.py); else the client relays each hop's outputs on.

    A session kept for reuse while it has no step to send is parked (park): its servers may then close it to
    make room, and its next step recomputes it (replay) where they did. A fork (fork) continues from its first
    positions in a new session whose servers share their pages of them with this one's (copy-on-write).
    """

    flowing, flow_grace = False, FLOW_GRACE  # see swarm/client/flowing.py (flowing: FLOWING_STEPS by default)
    pushes_missed = 0  # flowing steps whose push did not come in time: the client sent their inputs
    pushing = True  # whether relayed steps push (see Hop.takes_pushes): PUSHED_STEPS by default
    group = 0  # its steps travel with its group's (the engine loop's pipeline: see StepChannel.step)
    audited, _distrust_epoch = False, 0  # see __init__

    def __init__(self, services: ClientServices, route: Route, max_length: int, batch_size: int = 1,
                 on_wait: Optional[Callable[[str], None]] = None, forked: Optional[tuple["RemoteSession", int]] = None,
                 first_positions: int = NEXT_STEP_POSITIONS):
        """`forked`: (a session, a length) to start as a fork of (see fork), else it starts empty. `first_positions`:
        the most its first step will carry (a prompt's length, if known), told its servers at the opening."""
        self.services, self.route, self.max_length, self.batch_size = services, route, max_length, batch_size
        self.on_wait = on_wait
        self.position = 0  # tokens already in the servers' caches
        self.next_positions = first_positions  # what it declares its next step may carry (see step_async)
        self._steps = 0  # step ids: servers tell a pushed step from the client's copy of it by these
        self.flowing = flowing_by_default()
        self.pushing = pushing_by_default()
        self.audited = services.audits.rate > 0  # its hops record their outputs, for an audit once it ends
        self._distrust_epoch = services.bans.distrust_epoch  # a server distrusted since is left at the next step
        self.hops: list[Hop] = []
        try:
            if forked is None:
                self.hops = self._open_hops(0, route.num_blocks, replan=False)
            else:
                self._open_forks(*forked)
        except BaseException:
            self.close()
            raise

    step_id = property(lambda self: self._steps)  # the current step's id (servers tell steps apart by it)

    @property
    def chain(self) -> list[ChainLink]:
        return [hop.link for hop in self.hops]

    def park(self) -> None:
        """Tell every server of the chain that this session is idle, kept for reuse: each may close it to make
        room (its next step then recomputes it there or elsewhere, with the same outputs); the next step
        un-parks it. Never raises: a server gone, stalled (a step's timeout) or refusing is left to that next
        step. It waits for the servers' answers: a step sent after it must never find its session parked."""
        timeout = self.services.step_timeout

        async def park_all():
            return await asyncio.gather(*(hop.stream.park(timeout) for hop in self.hops), return_exceptions=True)

        for hop, result in zip(self.hops, self.services.loop.run(park_all())):
            if isinstance(result, BaseException):
                logger.debug("server %s did not park the session: %s", hop.link.peer_id, result)

    def fork(self, length: int, max_length: Optional[int] = None) -> "RemoteSession":
        """A new session on the same chain, at position `length`, whose servers share this one's cache of
        positions [0, length) instead of recomputing it; its inputs for a replay are this session's first
        `length`. A server that cannot fork (it closed this session, or refuses) is opened fresh and replayed:
        the outputs are the same either way."""
        max_length = self.max_length if max_length is None else max_length
        if not self.hops:
            raise ValueError("a closed session cannot be forked")
        if not 0 <= length <= min(self.position, max_length):
            raise ValueError(f"a fork's length must be in [0, {min(self.position, max_length)}] (the session's "
                             f"position, and the fork's max_length), got {length}")
        return RemoteSession(self.services, self.route, max_length, self.batch_size, self.on_wait, (self, length))

    def _open_forks(self, source: "RemoteSession", length: int) -> None:
        """Open a fork of each of `source`'s hops at `length`, else that hop's blocks afresh with a replay."""
        services = self.services
        for hop in source.hops:
            inputs = hop.inputs[:, :length] if hop.inputs is not None else None
            stream = InferenceStream(services.p2p, hop.link.peer_id, hop.link.start, hop.link.end,
                                     services.open_timeout, services.step_channels)
            forked = Hop(hop.link, stream, inputs, self.next_positions)
            if hop.outputs is not None:  # what the source's server returned for the shared positions: its own
                forked.record_outputs(hop.outputs[:, :length], 0)
            services.load.opened(hop.link.peer_id)
            try:
                services.loop.run(stream.open(self.max_length, self.batch_size, fork=(hop.stream, length),
                                              adapter=self.route.adapter, next_positions=self.next_positions))
                self.hops.append(forked)
                continue
            except Exception as error:  # gone, full, or the source session closed there: recompute
                logger.debug("server %s did not fork the session (%s): replaying %d positions", hop.link.peer_id,
                             error, length)
                self.close_hop(forked)
            replacement = self._open_hops(hop.link.start, hop.link.end)
            self.hops.extend(replacement)  # closed with the session if the replay fails
            if length:
                self._replay(replacement, inputs)
        self.position = length

    def step(self, hidden: torch.Tensor, position: Optional[int] = None,
             next_positions: Optional[int] = None) -> torch.Tensor:
        """Run new positions (batch, length, hidden) through every server; `position` < current rewinds.
        Call it from any thread but the client's event loop (see step_async)."""
        return self.services.loop.run(self.step_async(hidden, position, next_positions))

    async def step_async(self, hidden: torch.Tensor, position: Optional[int] = None,
                         next_positions: Optional[int] = None) -> torch.Tensor:
        """`step` on the client's event loop. The steady path never leaves the loop; a failover (routing, waiting,
        backoff, replay) and a spot check run on a worker thread, so that they hold up no other session.
        `next_positions`: the most positions the session's next step will carry, if the caller knows (a prompt's
        next chunk); it is declared from now on (servers compute pushes of no longer steps)."""
        return await self.run_step(self.begin_step(hidden, position, next_positions))

    def begin_step(self, hidden: torch.Tensor, position: Optional[int] = None,
                   next_positions: Optional[int] = None) -> StepState:
        """A step before its first hop: checked against max_length, numbered, in the wire's dtype. The gateway's
        engine loop steps the sessions that share a chain together (swarm/client/convoy.py), the others by
        run_step."""
        if next_positions is not None:
            if next_positions < 0:
                raise ValueError(f"next_positions must be >= 0, got {next_positions}")
            self.next_positions = next_positions
        position = self.position if position is None else position
        end = position + hidden.shape[1]
        if end > self.max_length:
            raise SessionLengthError(f"session max_length exceeded: {end} tokens would not fit in "
                                     f"max_length={self.max_length}")
        self._steps += 1
        timeout = self.services.step_timeout + STEP_SECONDS_PER_TOKEN * hidden.shape[1]
        wire_dtype = self.services.wire_dtype
        inputs = hidden if hidden.dtype == wire_dtype else hidden.to(wire_dtype)
        return StepState(inputs, position, end, timeout, hidden.dtype)

    def relays_plainly(self, step: StepState) -> bool:
        """Whether the step needs nothing of its own on its way: no spot check, no server left since the last
        step, not flowing; then it may go hop by hop with other sessions' (swarm/client/convoy.py)."""
        return (self.services.spot_checks.rate <= 0 and self.services.bans.distrust_epoch == self._distrust_epoch
                and not Flow.wanted(self, step.output))

    async def run_step(self, step: StepState) -> torch.Tensor:
        """A step begun (begin_step) through the whole chain: its spot check and its flow, if any, then go_on."""
        step.check = await self._prepare_step()
        step.flow = Flow.of_step(self, step.output, step.position, step.timeout)  # None: the step is relayed
        return await self.go_on(step, 0)

    async def go_on(self, step: StepState, index: int, fault: Optional[BaseException] = None) -> torch.Tensor:
        """The step through hops `index`.. (failing over from `fault` at `index` first, if given); its outputs.
        A server at fault (or a full cache) is replaced; any other error is the step's."""
        flow, check = step.flow, step.check
        pushing = flow is not None or self.pushing  # a flowing step goes on by its pushes
        try:
            while index < len(self.hops):
                if fault is not None:
                    if not isinstance(fault, (*SERVER_FAULTS, CacheFullError)):
                        raise fault
                    if flow is not None:  # the rest of the step is relayed
                        flow.abandon()
                    step.output, index = await asyncio.to_thread(self._fail_over, index, fault, step.output.shape[1])
                    fault = None
                    continue
                hop = self.hops[index]
                hop.record(step.output, step.position)
                following = self.following(index, step.output.shape[1], pushing)
                try:
                    if flow is not None and flow.flows_to(hop):
                        output = await flow.output(hop, step.output, step.position, following)
                    else:
                        output = await self._step_hop_async(hop, step.output, step.position, following)
                    if check is not None and check.link == hop.link:  # raises if the hop lied
                        await asyncio.to_thread(self.services.spot_checks.verify, check, hop.inputs, output)
                    self.answered(hop, step, output)
                    index += 1
                # a lie or a failure; a full cache is no fault, but the session goes elsewhere all the same
                except (*SERVER_FAULTS, CacheFullError) as error:
                    fault = error
        finally:
            if flow is not None:  # a step cancelled or failed: nothing is left waiting for it
                flow.abandon()
        return self.end_step(step)

    def following(self, index: int, positions: int, pushing: bool) -> Optional[Hop]:
        """The hop that hop `index`'s server pushes a step of `positions` to, if any."""
        following = self.hops[index + 1] if index + 1 < len(self.hops) else None
        return following if following is not None and following.takes_pushes(positions, pushing) else None

    def answered(self, hop: Hop, step: StepState, output: torch.Tensor) -> None:
        """A hop's outputs, checked: the step goes on with them (recorded for an audit, where there may be one)."""
        if self.audited:
            hop.record_outputs(output, step.position)
        step.output = output

    def end_step(self, step: StepState) -> torch.Tensor:
        self.position = step.end
        return step.output if step.output.dtype == step.dtype else step.output.to(step.dtype)

    async def _prepare_step(self):
        """Before a step: leave a server distrusted since the last one; the spot check to run, if this step has one."""
        if self.services.bans.distrust_epoch != self._distrust_epoch:
            await asyncio.to_thread(self._leave_distrusted)
        spot_checks = self.services.spot_checks
        return await asyncio.to_thread(spot_checks.plan, self.route, self.chain) if spot_checks.rate > 0 else None

    def _step_hop(self, hop: Hop, hidden: torch.Tensor, position: int) -> torch.Tensor:
        return self.services.loop.run(self._step_hop_async(hop, hidden, position))

    async def _step_hop_async(self, hop: Hop, hidden: torch.Tensor, position: int,
                              following: Optional[Hop] = None) -> torch.Tensor:
        """One server's step; it pushes its outputs on to `following`'s server (which then starts at once), and
        they come back here too: to be sent on anyway, and kept for a replay should `following` fail."""
        timeout = self.services.step_timeout + STEP_SECONDS_PER_TOKEN * hidden.shape[1]
        began = time.perf_counter()
        push_to = following.stream if following is not None else None
        output = await hop.stream.step(hidden, position, timeout, self._steps, push_to, self.next_positions,
                                       self.group)
        output = self.hop_outputs(hop, hidden, output)
        if hidden.shape[1] == 1:  # a decode step: what routing compares servers by (a prompt's time says little)
            self.services.load.observed(hop.link.peer_id, time.perf_counter() - began, hop.link.end - hop.link.start)
        return output

    def hop_outputs(self, hop: Hop, hidden: torch.Tensor, output) -> torch.Tensor:
        """What a hop's server answered `hidden` with, as its outputs: the error it failed with raised, and what
        cannot be its outputs refused as its fault (its finiteness is checked by the step channel)."""
        if isinstance(output, BaseException):
            raise output
        hop.declared = self.next_positions
        return checked_outputs(output, hidden, hop.link.peer_id, f"blocks {hop.link.start}:{hop.link.end}",
                               finite=True)

    def _fail_over(self, index: int, error: Exception, new_positions: int) -> tuple[torch.Tensor, int]:
        """Replace hop `index` by servers that hold its blocks, replaying its inputs; return the outputs for the
        newest positions and the index of the hop after the replacements."""
        failed = self.hops[index]
        start, end, inputs = failed.link.start, failed.link.end, failed.inputs
        code = getattr(error, "code", "server_unavailable")
        logger.warning("server %s failed (%s: %s); re-routing blocks %d:%d", failed.link.peer_id, code, error,
                       start, end)
        metrics.FAILOVERS.inc()
        metrics.FAILOVER_CAUSES.labels(code).inc()
        # a full cache is no fault: that server is only avoided, and keeps the session if no other can take it
        cache_full = isinstance(error, CacheFullError)
        if not cache_full and not isinstance(error, SessionClosedError):  # a closed session is no fault either
            self._ban(failed.link.peer_id, error)
        last_error: Exception = error
        for attempt in range(self.services.max_retries):
            if attempt:
                metrics.RETRIES.inc()
                time.sleep(min(0.5 * 2 ** (attempt - 1), 5.0))  # backoff: a replacement may still be starting
            try:
                replacement = self._open_hops(start, end, full={failed.link.peer_id} if cache_full else ())
            except MissingBlocksError as missing:
                if self.services.block_wait > 0:  # _open_hops has waited for the blocks already
                    raise
                last_error = missing
                continue
            try:
                outputs = self._replay(replacement, inputs)
            except SERVER_FAULTS as replay_error:
                last_error = replay_error
                for hop in replacement:
                    self.close_hop(hop)
                continue
            self.hops[index : index + 1] = replacement
            self.close_hop(failed)
            return outputs[:, -new_positions:], index + len(replacement)
        raise last_error

    def _replay(self, hops: list[Hop], inputs: torch.Tensor) -> torch.Tensor:
        """Every input the failed server had received, through its replacements, from position 0."""
        hidden = inputs
        for hop in hops:
            hop.record(hidden, 0)
            try:
                hidden = self._step_hop(hop, hidden, 0)
            except SERVER_FAULTS as error:
                self._ban(hop.link.peer_id, error)
                raise
            if self.audited:
                hop.record_outputs(hidden, 0)
        return hidden

    def _ban(self, peer_id: str, error: Exception) -> None:
        """A server at fault is banned for a while; one that answered with what cannot be outputs, as a liar."""
        if isinstance(error, MalformedOutputsError):
            self.services.bans.ban(peer_id, LIAR_BAN_SECONDS, distrust=True)
        else:
            self.services.bans.ban(peer_id)

    def _open_hops(self, start: int, end: int, full: Collection[str] = (), replan: bool = True) -> list[Hop]:
        return open_hops(self, start, end, full, replan)

    def close_hop(self, hop: Hop) -> None:
        self.services.load.opened(hop.link.peer_id, -1)
        self.services.loop.run(hop.stream.close())

    def _leave_distrusted(self) -> None:
        """A server of the chain was caught lying since the last step (an audit of another session): replace it and
        every hop after it, replaying their inputs, so that no cache downstream holds what it computed."""
        self._distrust_epoch = self.services.bans.distrust_epoch
        distrusted = self.services.bans.distrusted()
        index = next((index for index, hop in enumerate(self.hops) if hop.link.peer_id in distrusted), None)
        if index is None:
            return
        liar, inputs = self.hops[index], self.hops[index].inputs
        logger.warning("server %s was caught lying: blocks %d:%d of this session are replayed elsewhere",
                       liar.link.peer_id, liar.link.start, self.route.num_blocks)
        for hop in self.hops[index:]:
            self.close_hop(hop)
        self.hops[index:] = replacement = self._open_hops(liar.link.start, self.route.num_blocks)
        if inputs is not None:
            self._replay(replacement, inputs)

    def close(self) -> None:
        if self.audited and self.hops:  # drawn now, after every reply: no server could know which are audited
            self.services.audits.consider(self.route.prefix, self.route.num_blocks, self.route.adapter, self.hops)
        for hop in self.hops:
            self.close_hop(hop)
        self.hops = []

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
