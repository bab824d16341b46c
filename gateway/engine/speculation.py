"""Speculative decoding through the swarm: several tokens per round trip when a guess at them is right.

Over a wide-area swarm a decode step costs its chain's round trips, whatever the servers compute: with 2 hops of
50 ms no session beats ~10 tokens a second one token at a time. Here the gateway guesses the next few tokens
(a draft), sends them with the pending token in one step, and the servers return the logits after every position.
The gateway keeps the draft up to its first wrong token, plus the token the model chose there, so one step yields
1 to draft + 1 tokens. The next step starts where the kept tokens end: each server drops the rest of its cache
(swarm/server/sessions.py gives their pages back).

    prompt lookup    the draft is what followed the latest earlier occurrence of the context's last few tokens:
                     free (no model), and right often in replies that copy their prompt (code edits, JSON,
                     quotes, summaries)
    a draft model    where prompt lookup finds nothing, a small model of the same tokenizer guesses, if the
                     served model has one (drafts.py)
    verification     Sampler.verify (sequences.py): each token is chosen exactly as plain decoding chooses it (the argmax, or
                     one seeded draw), and a guess stands when it is that token: replies, greedy or seeded,
                     are the ones plain decoding gives, and a guess stands with probability p(guess)
    pacing           how long a draft pays to be: steps cost base + per_position * positions (measured per
                     model), a draft of k tokens yields (1 - a^(k+1)) / (1 - a) of them at acceptance rate a
                     (measured per reply): k maximises tokens per second, 0 when drafting does not pay

A structured output's grammar checks each kept token as plain decoding does (its mask at each position), and a
draft is cut where the grammar would refuse it, before it is sent.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Optional

import numpy as np

LOOKUP_NGRAM = 3  # the longest suffix of the context looked up; shorter ones are tried when it is not found
STEP_SAMPLES = 64  # recent decode steps the per-model cost is fitted on
ACCEPTANCE_PRIOR = (1.0, 2.0)  # (accepted, tried) pseudo-counts: a reply starts out at an acceptance rate of 0.5
ACCEPTANCE_MEMORY = 0.9  # each draft's weight against the ones before it
MIN_GAIN = 1.1  # a draft is sent only when it promises this many times the tokens per second of none


def prompt_lookup(tokens: list[int], most: int, ngram: int = LOOKUP_NGRAM) -> list[int]:
    """Up to `most` tokens that followed the latest earlier occurrence of the last `ngram` tokens of `tokens`
    (then of shorter suffixes, down to one token); [] when none occurred before."""
    if most <= 0 or len(tokens) < 2:
        return []
    context = np.asarray(tokens, dtype=np.int64)
    for size in range(min(ngram, len(context) - 1), 0, -1):
        suffix = context[-size:]
        starts = np.flatnonzero(context[: len(context) - size] == suffix[0])  # earlier occurrences only
        for start in starts[::-1]:
            if np.array_equal(context[start : start + size], suffix):
                return context[start + size : start + size + most].tolist()
    return []


class StepCosts:
    """What a decode step through the swarm costs a model, by how many positions it carries: a least-squares
    line through recent steps (seconds = base + per_position * positions). Shared by the model's requests.
    The sums the line needs are kept as steps come and go, so that reading it (every tick of a drafting
    session) costs a few additions, not a fit."""

    def __init__(self):
        self._samples: deque[tuple[int, float]] = deque()
        self._sums = [0, 0, 0.0, 0.0]  # positions, positions², seconds, positions x seconds (integers exact)
        self._lock = threading.Lock()

    def observed(self, positions: int, seconds: float) -> None:
        with self._lock:
            self._samples.append((positions, seconds))
            self._add(positions, seconds, 1)
            if len(self._samples) > STEP_SAMPLES:
                self._add(*self._samples.popleft(), -1)

    def _add(self, positions: int, seconds: float, sign: int) -> None:
        sums = self._sums
        sums[0] += sign * positions
        sums[1] += sign * positions * positions
        sums[2] += sign * seconds
        sums[3] += sign * positions * seconds

    def line(self) -> Optional[tuple[float, float]]:
        """(base, per_position), or None before any step. Until steps of two sizes are seen, a position is taken
        to cost a tenth of a one-position step: optimistic, so that drafts are tried and then measured."""
        with self._lock:
            count, (positions, squares, seconds, products) = len(self._samples), self._sums
        if not count:
            return None
        spread = count * squares - positions * positions  # count² x the variance of positions: 0 if all alike
        mean_positions, mean_seconds = positions / count, seconds / count
        if spread == 0:
            per_position = mean_seconds / mean_positions * 0.1
            return mean_seconds - per_position * mean_positions, per_position
        per_position = max((count * products - positions * seconds) / spread, 0.0)
        return max(mean_seconds - per_position * mean_positions, 1e-6), per_position


class Pacing:
    """One reply's draft length: the k (at most `most`) that maximises expected tokens per second."""

    def __init__(self, costs: StepCosts, most: int):
        self.costs, self.most = costs, most
        self._accepted, self._tried = ACCEPTANCE_PRIOR

    @property
    def acceptance(self) -> float:
        return self._accepted / self._tried

    def drafted(self, proposed: int, accepted: int) -> None:
        """A draft of `proposed` tokens kept its first `accepted`: each kept token was a success, the first
        wrong one (if any) a failure."""
        if proposed:
            self._accepted = ACCEPTANCE_MEMORY * self._accepted + accepted
            self._tried = ACCEPTANCE_MEMORY * self._tried + accepted + (accepted < proposed)

    def undrafted(self) -> None:
        """A step went without a draft: the acceptance rate drifts back towards the prior, so that a reply that
        stopped drafting (its text was new) tries again later (its text may have turned to copying)."""
        prior_accepted, prior_tried = ACCEPTANCE_PRIOR
        self._accepted = ACCEPTANCE_MEMORY * self._accepted + (1 - ACCEPTANCE_MEMORY) * prior_accepted
        self._tried = ACCEPTANCE_MEMORY * self._tried + (1 - ACCEPTANCE_MEMORY) * prior_tried

    def length(self) -> int:
        line = self.costs.line()
        if line is None or self.most <= 0:
            return self.most
        base, per_position = line
        rate = min(self.acceptance, 0.95)

        def tokens_per_second(k: int) -> float:
            return (1 - rate ** (k + 1)) / (1 - rate) / (base + per_position * (k + 1))

        best = max(range(self.most + 1), key=tokens_per_second)
        # what the line leaves out (verifying each row, other sessions' steps a longer one delays) is small but
        # not nothing: a draft must promise a clear gain
        return best if tokens_per_second(best) >= MIN_GAIN * tokens_per_second(0) else 0
