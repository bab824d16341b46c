"""Spot checks: now and then a client has other servers recompute one hop of a step, and bans a server that lies.

Nothing in the protocol shows that a server ran the right weights: it may hold a corrupted or another model,
or return garbage. With probability `rate` per step, the client picks one hop of the session's chain that
another server holds too, sends that hop's whole input history through the other server (a cache-less
forward: no session is needed there) and compares the outputs of the step's new positions. Honest servers
differ a little (their batches, kernels and dtypes differ), so outputs must agree within a relative
tolerance, not bit for bit.

Two servers that disagree do not say which of them lies: a third one referees, and the one it contradicts
is banned for a long time, logged and counted (metrics.SPOT_CHECKS). With no referee to be had, the
disagreement is only logged and counted. A liar caught on the session's own hop raises LyingServerError,
on which the session replaces it (replaying the hop's inputs), so the step's outputs are the honest ones.

Spot checks catch gross lies, with a chance that grows with every step; they prove nothing. A server that
lies by less than the tolerance, or only now and then, may go unseen for a while.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, replace
from typing import Iterable, Optional

import torch

from swarm.protocol import RemoteServer, ServerUnavailableError, SwarmError
from swarm.client.routing import ChainLink

logger = logging.getLogger(__name__)

LIAR_BAN_SECONDS = 24 * 3600.0
DEFAULT_TOLERANCE = 0.05  # relative error per position; corrupted weights are off by about 1 (100%)


class LyingServerError(ServerUnavailableError):
    """A server's outputs were contradicted by two others: the session fails over as from a dead server."""


@dataclass(frozen=True)
class Check:
    """This step's check: the hop `link` of the chain, and the other servers that hold its blocks, in the order
    they are asked (the first verifies, the others referee)."""

    link: ChainLink
    others: list[str]
    adapter: Optional[str] = None  # the session's LoRA adapter: the others run it too


def plan_check(chain: list[ChainLink], servers: Iterable[RemoteServer], excluded: Iterable[str],
               rng: random.Random) -> Optional[Check]:
    """A random hop of the chain that some other server (not excluded) could run too; None if none can."""
    servers, excluded = list(servers), set(excluded)
    checkable = []
    for link in chain:
        others = [server.peer_id for server in servers
                  if server.peer_id != link.peer_id and server.peer_id not in excluded
                  and server.info.start <= link.start and link.end <= server.info.end]
        if others:
            checkable.append(Check(link, rng.sample(others, len(others))))
    return rng.choice(checkable) if checkable else None


def agree(ours: torch.Tensor, theirs: torch.Tensor, tolerance: float) -> bool:
    """Whether two outputs (rows, positions, hidden) agree within `tolerance` relative error at every position."""
    if ours.shape != theirs.shape:
        return False
    ours, theirs = ours.float(), theirs.float()
    error = (ours - theirs).norm(dim=-1) / theirs.norm(dim=-1).clamp_min(1e-6)
    return bool((error <= tolerance).all())  # NaN compares false: a NaN never agrees


def find_liar(hop: str, outputs: torch.Tensor, opinions: Iterable[tuple[str, Optional[torch.Tensor]]],
              tolerance: float) -> tuple[str, Optional[str]]:
    """(outcome, liar) of comparing a hop's outputs with other servers' `opinions`, consumed lazily (a referee
    is asked only after a disagreement): "agreed"; "caught" and the peer the first referee contradicted;
    or "unresolved" (no opinion to be had, or no referee sides with either). An opinion of None: that server
    failed to answer, and says nothing."""
    opinions = ((peer, theirs) for peer, theirs in opinions if theirs is not None)
    first = next(opinions, None)
    if first is None:
        return "unresolved", None
    verifier, theirs = first
    if agree(outputs, theirs, tolerance):
        return "agreed", None
    for _, referee_outputs in opinions:
        if agree(outputs, referee_outputs, tolerance):
            return "caught", verifier
        if agree(theirs, referee_outputs, tolerance):
            return "caught", hop
    return "unresolved", None


class SpotChecker:
    """A client's spot checks (see the module's docstring); `rate` 0 turns them off."""

    def __init__(self, client, rate: float, tolerance: float = DEFAULT_TOLERANCE, rng: Optional[random.Random] = None):
        self.client, self.rate, self.tolerance = client, rate, tolerance
        self.rng = rng or random.Random()

    def plan(self, route, chain: list[ChainLink]) -> Optional[Check]:
        """The check to run at this step, if it is one of the steps checked."""
        if self.rate <= 0 or self.rng.random() >= self.rate:
            return None
        # from the client's shared view, as a session's opening takes it: a checked step waits for no lookup
        servers = self.client.servers(route.prefix, route.num_blocks, route.adapter, max_age=None)
        check = plan_check(chain, servers, self.client.bans.current(), self.rng)
        return replace(check, adapter=route.adapter) if check is not None else None

    def verify(self, check: Check, inputs: torch.Tensor, outputs: torch.Tensor) -> None:
        """Compare the hop's `outputs` (of its last positions) with what other servers compute from all its
        `inputs`; ban a liar, and raise LyingServerError if it is the hop's own server."""
        from swarm.client import metrics

        position = inputs.shape[1] - outputs.shape[1]
        opinions = ((peer, self._outputs(peer, check, inputs, position)) for peer in check.others)
        outcome, liar = find_liar(check.link.peer_id, outputs, opinions, self.tolerance)
        metrics.SPOT_CHECKS.labels(outcome).inc()
        blocks = f"blocks {check.link.start}:{check.link.end}"
        if outcome == "unresolved":
            logger.warning("spot check of %s on server %s: no other server confirmed its outputs, nor "
                           "contradicted them", blocks, check.link.peer_id)
        if liar is None:
            return
        logger.warning("spot check of %s: server %s returned wrong outputs; banned", blocks, liar)
        self.client.bans.ban(liar, LIAR_BAN_SECONDS, distrust=True)
        if liar == check.link.peer_id:
            raise LyingServerError(f"server {liar} returned wrong outputs for {blocks}")

    def _outputs(self, peer: str, check: Check, inputs: torch.Tensor, position: int) -> Optional[torch.Tensor]:
        """Another server's outputs for the positions from `position`, or None if it fails to give them."""
        from swarm.client.forwards import forward_on

        link = check.link
        try:  # a long session's history streams: it may be far over one message's 4 MiB
            outputs = self.client.loop.run(forward_on(self.client.node.p2p, peer, inputs, link.start, link.end,
                                                      self.client.timeout, check.adapter))
        except SwarmError as error:
            logger.info("spot check: server %s could not serve as a second opinion: %s", peer, error)
            return None
        return outputs[:, position:]
