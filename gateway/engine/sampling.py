"""SamplingParams, the one internal form every API's parameters converge to, and the choice of each token.

Sampling runs at the gateway on the LM head's logits, on the head's device, every row of an engine tick in one
batched call (sampler.py: one Sampler per generated sequence remembers what penalties and Mirostat need). Each
step, in this order:

    1. repetition_penalty    CTRL, as transformers applies it, over the whole context (prompt + output)
    2. presence, frequency   OpenAI's formula over the output's token counts (decayed each step, as Ai00 does)
    3. logit_bias            added to the listed tokens
    4. allowed               constrained decoding's mask: -inf everywhere else
    5. greedy argmax         when not do_sample or temperature == 0; only 1-4 can move the argmax
    6. temperature           on logits shifted to a maximum of 0, so that no temperature overflows
    7. Mirostat v1 or v2     llama.cpp's; it does its own truncation, so it replaces step 8
    8. top_k, typical_p, top_p, min_p, then one draw with the sequence's generator

Everything here is a pure function of tensors, so each stage is tested against its definition.
Filters mark removed tokens with -inf, never remove every token, and accept any (..., vocab) shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import torch

from swarm.client import decoding

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False  # False: greedy (argmax after penalties, logit_bias and the allowed mask)
    temperature: float = 1.0  # 0 with do_sample is greedy too
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off; keep tokens with prob >= min_p * max_prob
    typical_p: float = 1.0  # 1: off; locally typical sampling, as transformers' TypicalLogitsWarper
    repetition_penalty: float = 1.0  # 1: off; CTRL over the whole context
    presence_penalty: float = 0.0  # OpenAI: logits[j] -= presence_penalty * (count[j] > 0)
    frequency_penalty: float = 0.0  # OpenAI: logits[j] -= frequency_penalty * count[j]; output tokens only
    penalty_decay: float = 1.0  # Ai00: counts are multiplied by this each step before the new token adds 1
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token_id, bias) pairs; a dict is accepted and converted
    mirostat: int = 0  # 0 off, 1 Mirostat v1, 2 Mirostat v2 (Basu et al. 2021), as llama.cpp
    mirostat_tau: float = 5.0  # target surprise, in bits
    mirostat_eta: float = 0.1  # learning rate of mu
    seed: Optional[int] = None

    def __post_init__(self):
        # JSON gives logit_bias as a dict; pairs keep the frozen dataclass hashable and comparable.
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(token), float(value)) for token, value in bias))
        valid = {  # the widest ranges the APIs accept; anything else is a bug upstream, so fail loudly
            "temperature": self.temperature >= 0,
            "top_p": 0 < self.top_p <= 1,
            "min_p": 0 <= self.min_p <= 1,
            "typical_p": 0 < self.typical_p <= 1,
            "repetition_penalty": self.repetition_penalty > 0,
            "penalty_decay": 0 < self.penalty_decay <= 1,
            "mirostat": self.mirostat in (0, 1, 2),
            "logit_bias": all(token >= 0 and not math.isnan(value) for token, value in self.logit_bias),
        }
        invalid = [f"{name}={getattr(self, name)!r}" for name, ok in valid.items() if not ok]
        if invalid:
            raise ValueError(f"invalid sampling parameters: {', '.join(invalid)}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    def generator(self, device="cpu") -> Optional[torch.Generator]:
        """A seeded generator makes a sampled reply reproducible; None draws from torch's global state.
        Any integer is a seed: torch takes 64 bits, so larger ones (and negative ones) wrap around. It lives on the
        device the logits are sampled on (the LM head's): a draw never sends a vocabulary's probabilities across."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed & 0xFFFF_FFFF_FFFF_FFFF)


# ---- logit processors: (..., vocab) -> (..., vocab), new tensors; these may move the argmax -----------------


def apply_repetition_penalty(
    logits: torch.Tensor, context_ids: Union[Sequence[int], torch.Tensor], penalty: float
) -> torch.Tensor:
    """CTRL's penalty, exactly as transformers' RepetitionPenaltyLogitsProcessor: every token that occurs in
    `context_ids` (any order, repeats count once, ids past the vocab are ignored) has its logit divided by
    `penalty` when positive and multiplied when negative, so penalty > 1 always makes it less likely."""
    ids = torch.as_tensor(context_ids if torch.is_tensor(context_ids) else list(context_ids), dtype=torch.long)
    if penalty == 1.0 or ids.numel() == 0:
        return logits
    seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)  # (vocab,)
    ids = ids.flatten().to(logits.device)
    seen[ids[ids < logits.shape[-1]]] = True
    return _penalize_seen(logits, seen, penalty)


def _penalize_seen(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency(
    logits: torch.Tensor, counts: torch.Tensor, presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's penalties: logits[j] -= presence * (counts[j] > 0) + frequency * counts[j].
    `counts` (vocab,): how often each token occurred in the output (decayed in Ai00's variant, so fractional)."""
    if presence == 0 and frequency == 0:
        return logits
    counts = counts.to(device=logits.device, dtype=logits.dtype)
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts


def apply_logit_bias(logits: torch.Tensor, bias: Iterable[tuple[int, float]]) -> torch.Tensor:
    """Add each (token_id, value) pair's value to that token's logit; a repeated id adds up.
    A token id outside the logits is a ValueError (a client's mistake, not something to ignore)."""
    bias = list(bias)
    if not bias:
        return logits
    ids = torch.tensor([token for token, _ in bias], dtype=torch.long, device=logits.device)
    if int(ids.max()) >= logits.shape[-1] or int(ids.min()) < 0:
        raise ValueError(f"logit_bias: token ids must be in [0, {logits.shape[-1]}), got {ids.tolist()}")
    values = torch.tensor([value for _, value in bias], dtype=logits.dtype, device=logits.device)
    return logits.index_add(-1, ids, values.expand(*logits.shape[:-1], -1))


def apply_allowed(logits: torch.Tensor, allowed: Optional[torch.Tensor]) -> torch.Tensor:
    """Constrained decoding: -inf outside `allowed`, a bool mask (vocab,). A shorter mask (the tokenizer's
    vocab, when the LM head has padding rows) disallows the tokens past its end."""
    if allowed is None:
        return logits
    vocab = logits.shape[-1]
    allowed = allowed.to(device=logits.device, dtype=torch.bool)[..., :vocab]
    if allowed.shape[-1] < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(*allowed.shape[:-1], vocab - allowed.shape[-1])], dim=-1)
    return logits.masked_fill(~allowed, NEG_INF)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, shifted so that the largest is 0 (softmax is the same): a tiny temperature then sends
    the others to -inf, where dividing the raw logits would overflow to inf and softmax would give nan. A logit
    already at +inf (an extreme repetition penalty) counts as the largest finite number, and a temperature too
    small for the logits' dtype as the smallest it has (rather than 0)."""
    limits = torch.finfo(logits.dtype)
    logits = logits.nan_to_num(nan=NEG_INF, posinf=limits.max)
    return (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, limits.tiny)


# ---- filters: (..., vocab) -> (..., vocab) with removed tokens at -inf; after temperature --------------------


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k highest logits (and any tied with the k-th); k <= 0 is off. swarm.client.decoding's, made total."""
    return decoding.filter_top_k(logits, k) if k > 0 else logits


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose probability reaches p; p >= 1 is off."""
    return decoding.filter_top_p(logits, p) if p < 1 else logits


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p times the most likely one's (which always stays)."""
    if min_p <= 0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), NEG_INF)


def filter_typical(logits: torch.Tensor, mass: float) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022), step for step as transformers' TypicalLogitsWarper:
    rank tokens by how far their surprise is from the distribution's entropy, keep the closest until `mass`
    is reached. mass >= 1 is off."""
    if mass >= 1:
        return logits
    log_probs = torch.log_softmax(logits, dim=-1)
    entropy = -(log_probs * log_probs.exp()).nansum(dim=-1, keepdim=True)  # nansum: -inf * 0 at masked tokens
    distance = (-log_probs - entropy).abs()
    sorted_distance, order = torch.sort(distance, dim=-1)
    cumulative = torch.softmax(logits.gather(-1, order), dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)  # (..., 1)
    remove = sorted_distance > sorted_distance.gather(-1, last)
    remove[..., :1] = False  # the most typical token always stays
    return logits.masked_fill(remove.scatter(-1, order, remove), NEG_INF)


def draw(logits: torch.Tensor, generator: Optional[torch.Generator] = None) -> int:
    """One token from softmax(logits), a (vocab,) vector."""
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


# ---- Mirostat (Basu et al. 2021), as llama.cpp: logits (vocab,) after temperature -> (token, next mu) -------
# mu is the largest surprise (in bits) allowed; it starts at 2 * tau and follows the observed surprise of each
# drawn token (measured in the truncated, renormalised distribution) towards the target tau.


def mirostat_v2_step(
    logits: torch.Tensor, mu: float, tau: float, eta: float, generator: Optional[torch.Generator] = None
) -> tuple[int, float]:
    """Mirostat 2.0: drop tokens whose surprise -log2(p) exceeds mu (never the most likely), renormalise,
    draw, then mu -= eta * (observed surprise - tau)."""
    probs = torch.softmax(logits.float(), dim=-1)  # (vocab,)
    keep = -torch.log2(probs) <= mu
    keep[probs.argmax()] = True
    truncated = torch.where(keep, probs, 0.0)
    truncated = truncated / truncated.sum()
    token = int(torch.multinomial(truncated, 1, generator=generator))
    surprise = -math.log2(float(truncated[token]))
    return token, mu - eta * (surprise - tau)


def mirostat_v1_step(
    logits: torch.Tensor, mu: float, tau: float, eta: float, n_vocab: int,
    generator: Optional[torch.Generator] = None, m: int = 100,
) -> tuple[int, float]:
    """Mirostat 1.0: estimate the Zipf exponent s_hat from the m most likely tokens, derive the k whose top-k
    has expected surprise mu for a vocabulary of n_vocab, draw from the renormalised top k, then update mu."""
    probs = torch.softmax(logits.float(), dim=-1)  # (vocab,)
    sorted_probs, order = torch.sort(probs, descending=True)
    top = sorted_probs[:m].double()
    top = top[top > 0]  # masked-out tokens (p = 0) would make the log-ratios infinite
    # least squares through the origin of b_i = log(p_i / p_i+1) on t_i = log((i + 2) / (i + 1)), i < m - 1
    i = torch.arange(len(top) - 1, dtype=torch.float64)
    t = torch.log((i + 2) / (i + 1))
    s_hat = (t * torch.log(top[:-1] / top[1:])).sum() / (t * t).sum()
    epsilon = s_hat - 1
    k = (epsilon * 2.0 ** torch.tensor(mu, dtype=torch.float64) / (1 - n_vocab ** -epsilon)) ** (1 / s_hat)
    # like llama.cpp's max(int(k), 1); a degenerate estimate (one candidate, s_hat = 1) leaves just the best
    k = int(k.nan_to_num(nan=1.0).clamp(1, len(probs))) if len(top) > 1 else 1
    kept = sorted_probs[:k] / sorted_probs[:k].sum()
    index = int(torch.multinomial(kept, 1, generator=generator))
    surprise = -math.log2(float(kept[index]))
    return int(order[index]), mu - eta * (surprise - tau)
