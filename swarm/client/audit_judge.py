"""Audits after the fact (issue 41): the fingerprint a client keeps of each hop's outputs, and the judge that
compares it with an honest recomputation's.

A fingerprint is a fixed random projection of each position's hidden state to FINGERPRINT_DIMS float32 values
(4 * FINGERPRINT_DIMS bytes per position per hop). Being linear, it keeps what a judge needs: the relative error
||P(c - r)|| / ||P r|| of a position follows ||c - r|| / ||r|| (Johnson-Lindenstrauss), whatever produced the
difference. The projection is Rademacher (+-1/sqrt(hidden)), drawn by torch's CPU generator from a seed made of
the hidden size and an optional key, so every process on every machine draws the same one. A server that knows
the projection could hide a change in its null space: a client that fears a server crafting its outputs (not
merely computing them cheaply) keys its fingerprints with a secret of its own, and recomputes them itself.

The judge: per position, e_t = ||c_t - r_t|| / ||r_t|| of the claimed and the recomputed fingerprints; two
tests, each threshold set from bench/audits.py's calibration on honest servers (float32, bfloat16, float16
spans; decode against prefill; alone and batched with other sessions; the same bfloat16 inputs to both):

    gross   max_t e_t above GROSS_THRESHOLDS[precision]: a wrong model, a skipped block, noise, a lie on a
            few positions
    subtle  the mean of e_t above SUBTLE_THRESHOLDS[precision]: a model near the right one (quantized
            weights, a fine-tune) changes every position a little; a lie on part of them (decode steps
            only) moves the mean where it would not move a median. Honest e_t are bounded (no heavy tail
            to be robust to: the attention sink's huge norm makes its e_t the smallest)

`precision` is the coarser dtype of the two servers (bfloat16 > float16 > float32, as rpc_info declares them):
two float32 servers agree to 1e-6, so a float32 server that computes in bfloat16 is caught by the subtle test.
Thresholds (bench/figures/audits.json): gross at 3x the largest honest e_t seen (a log-normal fit of honest
e_t puts crossing it below 1e-12 per position); subtle where a normal fit of honest means puts one audit in a
million (at any T from SUBTLE_MIN_POSITIONS: the means spread as much at 256 positions as at 8, their spread
being between pairs of servers, not within a sequence); sequences shorter get the gross test alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

FINGERPRINT_DIMS = 16
_SEED_BASE = 0x41_0041  # issue 41: with the hidden size (and a key), the projection's seed

# set from bench/audits.py's calibration (bench/figures/audits.json): see the module's docstring
# float32: a floor, 40x what one CPU shows (1e-6 in 7,680 positions): other kernels sum in other orders
GROSS_THRESHOLDS = {"float32": 1e-4, "float16": 1.3e-2, "bfloat16": 8.5e-2}
SUBTLE_THRESHOLDS = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 2.1e-2}
SUBTLE_MIN_POSITIONS = 8
PRECISIONS = ("float32", "float16", "bfloat16")  # finer to coarser


@lru_cache(maxsize=16)
def projection(hidden_size: int, key: int = 0) -> torch.Tensor:
    """The (hidden_size, FINGERPRINT_DIMS) Rademacher projection, the same in every process for the same key."""
    generator = torch.Generator(device="cpu").manual_seed(_SEED_BASE * 1_000_003 + hidden_size + key * 7_919)
    signs = torch.randint(0, 2, (hidden_size, FINGERPRINT_DIMS), generator=generator, dtype=torch.int64)
    return (signs * 2 - 1).to(torch.float32) / math.sqrt(hidden_size)


def fingerprint(hidden: torch.Tensor, key: int = 0) -> torch.Tensor:
    """(..., hidden_size) hidden states of any float dtype -> (..., FINGERPRINT_DIMS) float32, on the CPU."""
    return hidden.detach().to("cpu", torch.float32) @ projection(hidden.shape[-1], key)


@dataclass(frozen=True)
class Verdict:
    """Whether the claimed outputs agree with the recomputation. Disagreeing says that one of the two servers is
    wrong, not which: a referee's recomputation decides (as spot_check.find_liar does)."""

    honest: bool
    score: float  # the failed test's statistic over its threshold (> 1: dishonest), else the larger ratio
    reason: str


def coarser(*dtypes: str) -> str:
    """The coarsest of the servers' dtypes (by name); an unknown one counts as bfloat16, the loosest."""
    return max((dtype if dtype in PRECISIONS else "bfloat16" for dtype in dtypes), key=PRECISIONS.index)


def position_errors(claimed: torch.Tensor, recomputed: torch.Tensor) -> torch.Tensor:
    """e_t = ||c_t - r_t|| / ||r_t|| per position, (T,) float64."""
    claimed, recomputed = claimed.double(), recomputed.double()
    return (claimed - recomputed).norm(dim=-1) / recomputed.norm(dim=-1).clamp_min(1e-12)


def judge(claimed: torch.Tensor, recomputed: torch.Tensor, precision: str = "bfloat16",
          gross_threshold: Optional[float] = None, subtle_threshold: Optional[float] = None) -> Verdict:
    """Whether a hop's claimed fingerprints (T, DIMS) agree with an honest recomputation's, for servers whose
    coarser dtype is `precision` (see coarser). Thresholds default to the calibrated ones."""
    if claimed.shape != recomputed.shape or claimed.ndim != 2 or claimed.shape[0] == 0:
        return Verdict(False, math.inf, f"shape mismatch: claimed {tuple(claimed.shape)}, "
                                        f"recomputed {tuple(recomputed.shape)}")
    for name, fingerprints in (("claimed", claimed), ("recomputed", recomputed)):
        if not bool(torch.isfinite(fingerprints).all()):
            return Verdict(False, math.inf, f"{name} fingerprints hold NaN or infinity")
    errors = position_errors(claimed, recomputed)
    precision = coarser(precision)
    gross = GROSS_THRESHOLDS[precision] if gross_threshold is None else gross_threshold
    subtle = SUBTLE_THRESHOLDS[precision] if subtle_threshold is None else subtle_threshold
    if len(claimed) < SUBTLE_MIN_POSITIONS:  # a mean of so few is as loose as one position: the gross test's
        subtle = None
    worst, worst_at = float(errors.max()), int(errors.argmax())
    if worst > gross:
        return Verdict(False, worst / gross, f"gross: max relative error {worst:.3g} at position {worst_at} "
                                             f"> {gross:.3g} ({precision})")
    typical = float(errors.mean())
    if subtle is not None and typical > subtle:
        return Verdict(False, typical / subtle, f"subtle: mean relative error {typical:.3g} over "
                                                f"{len(errors)} positions > {subtle:.3g} ({precision})")
    score = max(worst / gross, 0.0 if subtle is None else typical / subtle)
    return Verdict(True, score, f"agrees: max relative error {worst:.3g} <= {gross:.3g}, mean {typical:.3g} "
                                f"<= {subtle if subtle is not None else 'none'} ({precision})")
