"""SamplingParams, the one internal form every API's parameters converge to, and the pure choice of a token.

Sampling runs at the gateway on the LM head's logits: penalties first (they see the whole session's
history), then swarm.decoding's greedy or temperature / top-k / top-p sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from swarm.decoding import next_token


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None

    def generator(self) -> Optional[torch.Generator]:
        """A seeded generator makes a sampled reply reproducible; None draws from torch's global state."""
        return torch.Generator().manual_seed(self.seed) if self.seed is not None else None


def apply_repetition_penalty(logits: torch.Tensor, history: Sequence[int], penalty: float) -> torch.Tensor:
    """CTRL's penalty, as transformers applies it: seen tokens' logits divided by it if positive, else multiplied."""
    if penalty == 1.0 or not history:
        return logits
    seen = torch.tensor(sorted(set(history)), dtype=torch.long)
    scores = logits[..., seen]
    logits = logits.clone()
    logits[..., seen] = torch.where(scores > 0, scores / penalty, scores * penalty)
    return logits


def choose_token(
    logits: torch.Tensor, history: Sequence[int], params: SamplingParams, generator: Optional[torch.Generator]
) -> int:
    """The next token after `logits` (vocab,), given the session's `history` of token ids."""
    logits = apply_repetition_penalty(logits.float(), history, params.repetition_penalty)
    temperature = params.temperature if params.do_sample and params.temperature > 0 else 0.0
    return int(next_token(logits[None], temperature, params.top_k, params.top_p, generator)[0])
