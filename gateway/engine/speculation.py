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
    verification     Sampler.verify: each token is chosen exactly as plain decoding chooses it (the argmax, or
                     one seeded draw), and a guess stands when it is that token: replies, greedy or seeded,
                     are the ones plain decoding gives, and a guess stands with probability p(guess)
    pacing           how long a draft pays to be: steps cost base + per_position * positions (measured per
                     model), a draft of k tokens yields (1 - a^(k+1)) / (1 - a) of them at acceptance rate a
                     (measured per reply): k maximises tokens per second, 0 when drafting does not pay

A structured output's grammar checks each kept token as plain decoding does (its mask at each position), and a
draft is cut where the grammar would refuse it, before it is sent.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from gateway.engine.metrics import ACCEPTED_DRAFT_TOKENS, DRAFT_TOKENS

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
    line through recent steps (seconds = base + per_position * positions). Shared by the model's requests."""

    def __init__(self):
        self._samples: deque[tuple[int, float]] = deque(maxlen=STEP_SAMPLES)
        self._lock = threading.Lock()

    def observed(self, positions: int, seconds: float) -> None:
        with self._lock:
            self._samples.append((positions, seconds))

    def line(self) -> Optional[tuple[float, float]]:
        """(base, per_position), or None before any step. Until steps of two sizes are seen, a position is taken
        to cost a tenth of a one-position step: optimistic, so that drafts are tried and then measured."""
        with self._lock:
            samples = list(self._samples)
        if not samples:
            return None
        positions = np.array([count for count, _ in samples], dtype=np.float64)
        seconds = np.array([took for _, took in samples], dtype=np.float64)
        if np.ptp(positions) == 0:
            per_position = float(seconds.mean() / positions[0]) * 0.1
            return float(seconds.mean()) - per_position * positions[0], per_position
        per_position, base = np.polyfit(positions, seconds, 1)
        per_position = max(float(per_position), 0.0)
        return max(float(seconds.mean() - per_position * positions.mean()), 1e-6), per_position


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


@dataclass(frozen=True)
class Emitted:
    token: int
    logits: object  # torch.Tensor (vocab,): the raw logits it was chosen from (for logprobs)
    completes_grammar: bool = False  # the structured output's grammar is finished with this token


class Decoder:
    """One reply's tokens, a step through the swarm at a time: each `step` sends the pending tokens (and a draft,
    when pacing says one pays) and returns the tokens it yields, keeping session.history to what the servers
    hold of them (the last token yielded is pending: sent with the next step)."""

    def __init__(self, session, sampler, constraint, stop_ids: set[int], run_step: Callable, pacing: Optional[Pacing],
                 guesses=None):
        """`run_step(session, tokens, every_position)`: logits after the last token, or after each; it appends the
        tokens to session.history. `pacing` None: no drafts (speculation off). `guesses`: a draft model's
        (drafts.ReplyDrafts), asked where prompt lookup finds nothing."""
        self.session, self.sampler, self.constraint, self.stop_ids = session, sampler, constraint, stop_ids
        self.run_step, self.pacing, self.guesses = run_step, pacing, guesses
        self.vocab_size = session.model.vocab_size

    def step(self, feed: list[int], room: int) -> list[Emitted]:
        """The tokens one step yields, at most `room` (the reply's remaining budget): they end at a stop token
        or where the grammar finishes, too."""
        draft = self._draft(feed, room)
        sent_at = len(self.session.history)
        began = time.perf_counter()
        logits = self.run_step(self.session, feed + draft, every_position=bool(draft))
        if self.pacing is not None and len(feed) == 1:
            self.pacing.costs.observed(1 + len(draft), time.perf_counter() - began)
        if not draft:
            if self.pacing is not None:
                self.pacing.undrafted()
            return [self._emit(logits, None)[0]]
        emitted, kept = self._verify(logits[len(feed) - 1 :], draft, room)
        self.pacing.drafted(len(draft), kept)
        DRAFT_TOKENS.labels(self.session.model.name).inc(len(draft))
        ACCEPTED_DRAFT_TOKENS.labels(self.session.model.name).inc(kept)
        # the servers hold feed + draft; what they keep is feed and the draft tokens yielded before the last one
        del self.session.history[sent_at + len(feed) + len(emitted) - 1 :]
        return emitted

    def _draft(self, feed: list[int], room: int) -> list[int]:
        if self.pacing is None or len(feed) != 1:  # a prompt's step goes alone: its cost would skew the pacing
            return []
        session = self.session
        space = session.max_length - len(session.history) - len(feed)  # positions the servers may still take
        most = min(self.pacing.length(), room - 1, space)
        context = session.history + feed
        draft = prompt_lookup(context, most)
        if not draft and self.guesses is not None:
            draft = self.guesses.propose(context, most)
        draft = list(itertools.takewhile(lambda token: token < self.vocab_size, draft))  # ids past the LM head end it
        if draft and self.constraint is not None:
            draft = draft[: self.constraint.valid_prefix(draft)]
        return draft

    def _verify(self, rows, draft: list[int], room: int) -> tuple[list[Emitted], int]:
        """The tokens yielded, and how many of them are the draft's: rows[i] are the logits after the draft's
        first i tokens (i = 0..len(draft))."""
        emitted: list[Emitted] = []
        for index, guess in enumerate(draft):
            last, kept = self._emit(rows[index], guess)
            emitted.append(last)
            if not kept or self._ends(last) or len(emitted) == room:
                return emitted, index + kept
        emitted.append(self._emit(rows[len(draft)], None)[0])
        return emitted, len(draft)

    def _emit(self, logits, guess: Optional[int]) -> tuple[Emitted, bool]:
        """The token chosen after `logits` (checked against the guess, if any), taken into the grammar's state."""
        allowed = self.constraint.allowed() if self.constraint is not None else None
        if guess is None:
            token, kept = self.sampler(logits, allowed), False
        else:
            token, kept = self.sampler.verify(logits, guess, allowed)
        finished = False
        if self.constraint is not None and token not in self.stop_ids:
            self.constraint.accept(token)
            finished = self.constraint.is_finished()
        return Emitted(token, logits, finished), kept

    def _ends(self, chosen: Emitted) -> bool:
        return chosen.token in self.stop_ids or chosen.completes_grammar
