"""One server of a session's chain as the client keeps it (Hop): its stream, and every input it was sent, so that
a replacement server can be replayed onto (swarm/client/remote_session.py) and a flowing step knows what each
hop was told (swarm/client/flowing.py)."""

from __future__ import annotations

from typing import Optional

import torch

from swarm.client.routing import ChainLink
from swarm.client.step_channel import NEXT_STEP_POSITIONS
from swarm.client.stubs import InferenceStream


class Hop:
    """One server of a session's chain, and every input it has been sent (to replay onto a replacement).

    Inputs are kept as the chunks they were sent in: a step appends one (never copying what came before, so a
    reply's record costs its own size), a rewind drops chunks from the end, and reading them joins them once."""

    def __init__(self, link: ChainLink, stream: InferenceStream, inputs: Optional[torch.Tensor] = None,
                 declared: int = NEXT_STEP_POSITIONS):
        self.link, self.stream = link, stream
        self.declared = declared  # what its server was last told the next step may carry: pushes up to that run
        self.relayed_steps = 0  # steps still relayed to it, not flowing, after a push to it was lost (flowing.py)
        self._chunks: list[torch.Tensor] = []  # (batch, positions, hidden) each, in order of position
        self._length = 0  # positions recorded
        if inputs is not None:
            self.record(inputs, 0)

    @property
    def inputs(self) -> Optional[torch.Tensor]:
        """(batch, positions so far, hidden), or None before any step."""
        if not self._chunks:
            return None
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks, dim=1)]
        return self._chunks[0]

    def record(self, hidden: torch.Tensor, position: int) -> None:
        """Inputs sent for positions position..; a position below what was sent rewinds the record there."""
        while self._chunks and self._length - self._chunks[-1].shape[1] >= position:
            self._length -= self._chunks.pop().shape[1]
        if self._length > position:  # the last chunk straddles the rewind
            last = self._chunks[-1]
            self._chunks[-1] = last[:, : last.shape[1] - (self._length - position)]
            self._length = position
        self._chunks.append(hidden)
        self._length += hidden.shape[1]
