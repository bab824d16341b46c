"""One server of a session's chain as the client keeps it (Hop): its stream, and every input it was sent, so that
a replacement server can be replayed onto (swarm/client/remote_session.py) and a flowing step knows what each
hop was told (swarm/client/flowing.py)."""

from __future__ import annotations

from typing import Optional

import torch

from swarm.client.routing import ChainLink
from swarm.client.step_channel import NEXT_STEP_POSITIONS
from swarm.client.stubs import InferenceStream


# a flowing answer later than this many times the hop's lag is taken for a lost push (the client sends the
# inputs itself; an answer that comes after all still counts, see flowing.py), and never before MIN_FLOW_GRACE
# seconds: a loaded machine's scheduling jitter
FLOW_GRACE_LAGS, MIN_FLOW_GRACE = 4.0, 0.05


def pushing_by_default() -> bool:
    """The PUSHED_STEPS setting: relayed steps ask each server to push its outputs on to the next (1, unset), or
    never (0: a block server with few cores spares the pushes' messages; on this 2-core machine, with the tiny
    model and two servers, one session went 2.02 ms a token with pushes against 2.13 without, the servers' CPU
    1.44-1.76 against 1.02-1.69 ms a token, medians of four alternated runs each)."""
    from config import said

    return said("PUSHED_STEPS") is not False


class Positions:
    """Hidden states (batch, positions, hidden) by position, kept as the chunks they came in: a step appends one
    (never copying what came before, so a reply's record costs its own size), a rewind drops chunks from the end,
    and reading them joins them once."""

    def __init__(self):
        self._chunks: list[torch.Tensor] = []  # in order of position
        self._length = 0  # positions recorded

    @property
    def joined(self) -> Optional[torch.Tensor]:
        """(batch, positions so far, hidden), or None before any."""
        if not self._chunks:
            return None
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks, dim=1)]
        return self._chunks[0]

    def record(self, hidden: torch.Tensor, position: int) -> None:
        """Positions position..; a position below what was recorded rewinds the record there."""
        while self._chunks and self._length - self._chunks[-1].shape[1] >= position:
            self._length -= self._chunks.pop().shape[1]
        if self._length > position:  # the last chunk straddles the rewind
            last = self._chunks[-1]
            self._chunks[-1] = last[:, : last.shape[1] - (self._length - position)]
            self._length = position
        self._chunks.append(hidden)
        self._length += hidden.shape[1]


class Hop:
    """One server of a session's chain, every input it has been sent (to replay onto a replacement), and, where
    the session may be audited, every output it returned (swarm/client/audits.py)."""

    def __init__(self, link: ChainLink, stream: InferenceStream, inputs: Optional[torch.Tensor] = None,
                 declared: int = NEXT_STEP_POSITIONS):
        self.link, self.stream = link, stream
        self.declared = declared  # what its server was last told the next step may carry: pushes up to that run
        self.relayed_steps = 0  # steps still relayed to it, not flowing, after a push to it was lost (flowing.py)
        self.pushes_lost_in_a_row = 0  # flowing steps to it whose push was lost, with no flowing answer since
        self.flow_lag: Optional[float] = None  # seconds its flowing answers come after the previous hop's outputs
        self._inputs, self._outputs = Positions(), Positions()
        if inputs is not None:
            self.record(inputs, 0)

    @property
    def inputs(self) -> Optional[torch.Tensor]:
        """(batch, positions so far, hidden), or None before any step."""
        return self._inputs.joined

    @property
    def outputs(self) -> Optional[torch.Tensor]:
        """What its server returned for every position (where recorded: record_outputs), or None."""
        return self._outputs.joined

    def record(self, hidden: torch.Tensor, position: int) -> None:
        """Inputs sent for positions position..; a position below what was sent rewinds the record there."""
        self._inputs.record(hidden, position)

    def record_outputs(self, outputs: torch.Tensor, position: int) -> None:
        """What its server returned for positions position.. (for the next hop, the same tensors as its inputs:
        kept twice only once either is joined)."""
        self._outputs.record(outputs, position)

    def takes_pushes(self, positions: int, pushing: bool) -> bool:
        """Whether the server before it should push it a step of `positions` positions: within what its server was
        told to compute, where the session pushes at all."""
        return pushing and positions <= self.declared

    def flowed(self, lag: float) -> None:
        """Its flowing answer came `lag` seconds after the previous hop's outputs (an exponential moving average;
        a lag above it counts at once, so that the grace keeps up with a server or network slowing down)."""
        self.pushes_lost_in_a_row = 0
        self.flow_lag = lag if self.flow_lag is None or lag > self.flow_lag else 0.8 * self.flow_lag + 0.2 * lag

    def flow_grace(self, most: float, chain: list["Hop"]) -> float:
        """Seconds to wait for its flowing answer once the previous hop's outputs came: FLOW_GRACE_LAGS times its
        lag (else the largest of its chain's hops: a replacement joins a chain whose lags are known), at least
        MIN_FLOW_GRACE; `most` while no hop of the chain has flowed."""
        lags = [hop.flow_lag for hop in ([self] if self.flow_lag is not None else chain) if hop.flow_lag is not None]
        if not lags:
            return most
        return min(most, max(MIN_FLOW_GRACE, FLOW_GRACE_LAGS * max(lags)))
