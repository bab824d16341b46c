"""Every row of an engine tick sampled in one batched call, on the LM head's device.

    tokens = sample_rows(logits, samplers, allowed)   # (rows, vocab) -> (rows,) token ids, still on the device

Each generated sequence has a Sampler: its SamplingParams and what its rules remember (tokens seen, for the
repetition penalty; decayed output counts, for the presence and frequency penalties; Mirostat's mu; a seeded
generator), all on the head's device. sample_rows runs sampling.py's stages over the rows together: rows that share
a stage's setting (usually all of them) go through it as one tensor, so a tick of 64 plain rows costs the same few
operators as one. Only stateful rules work row by row: a seeded draw (its own generator, so that a seeded reply is
the same whatever else runs beside it) and Mirostat (its mu follows each draw). The chosen ids stay on the device:
the caller moves them to the host once per tick, with nothing else of the vocabulary.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Hashable, Optional, Sequence

import torch

from gateway.engine.sampling import (
    NEG_INF,
    SamplingParams,
    _penalize_seen,
    apply_allowed,
    apply_logit_bias,
    apply_presence_frequency,
    apply_temperature,
    filter_min_p,
    filter_top_k,
    filter_top_p,
    filter_typical,
    mirostat_v1_step,
    mirostat_v2_step,
)

IMPOSSIBLE = -1  # the id sample_rows gives a row whose mask and logit_bias exclude every token


class Sampler:
    """One sequence's sampling state. Call it on one row of logits for one token (what verifying a draft does);
    an engine tick samples all its rows with sample_rows."""

    def __init__(self, params: SamplingParams, vocab_size: int, context: Sequence[int] = (), device="cpu"):
        """`vocab_size`: the logits' length (the state grows if logits turn out longer); `context`: token ids
        already in the sequence (prompt, earlier turns), seen by the repetition penalty only; `device`: where the
        logits are (the LM head's)."""
        for token, _ in params.logit_bias:  # checked here, in the request's thread: never inside a tick
            if token >= vocab_size:
                raise ValueError(f"logit_bias: token ids must be in [0, {vocab_size}), got {token}")
        context = [int(token) for token in context]
        self.params, self.vocab_size, self.device = params, vocab_size, torch.device(device)
        self.generator = params.generator(self.device)
        self.penalizes_context = params.repetition_penalty != 1.0
        self.counts_output = params.presence_penalty != 0 or params.frequency_penalty != 0
        size = max([vocab_size, *(token + 1 for token in context)])
        self.seen = torch.zeros(size, dtype=torch.bool, device=self.device)  # (vocab,) in context or output
        if self.penalizes_context and context:
            self.seen[torch.tensor(context, device=self.device)] = True
        self.counts = torch.zeros(size, device=self.device)  # (vocab,) decayed output counts
        self.bias = self._bias_row(params.logit_bias, size)  # (vocab,) or None
        self.mu = 2.0 * params.mirostat_tau  # Mirostat's surprise ceiling, in bits

    def _bias_row(self, bias: tuple[tuple[int, float], ...], size: int) -> Optional[torch.Tensor]:
        """logit_bias as one row over the vocabulary, made once here, in the request's thread: each tick then adds
        it as a tensor already on the head's device, whatever the number of entries."""
        if not bias:
            return None
        return apply_logit_bias(torch.zeros(size, device=self.device), bias)

    def processed_logits(self, logits: torch.Tensor, allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(vocab,) logits after penalties, logit_bias and the allowed mask, before temperature; no state change."""
        if logits.dim() != 1:
            raise ValueError(f"Sampler takes one sequence's logits, shape (vocab,), got {tuple(logits.shape)}")
        return _processed(logits.detach().to(self.device, torch.float32)[None], [self], [allowed])[0]

    def __call__(self, logits: torch.Tensor, allowed: Optional[torch.Tensor] = None) -> int:
        """The next token after `logits` (vocab,); never one outside `allowed` (a bool mask (vocab,))."""
        if logits.dim() != 1:
            raise ValueError(f"Sampler takes one sequence's logits, shape (vocab,), got {tuple(logits.shape)}")
        token = int(sample_rows(logits.detach().to(self.device, torch.float32)[None], [self], [allowed])[0])
        if token == IMPOSSIBLE:
            raise ValueError("no token can be chosen: the allowed mask and logit_bias exclude every token")
        return token

    def verify(self, logits: torch.Tensor, draft: int, allowed: Optional[torch.Tensor] = None) -> tuple[int, bool]:
        """The next token after `logits`, chosen exactly as __call__ chooses it, and whether a drafter's guess
        `draft` was that token. Keeping a guess only when it is the token drawn keeps it with probability p(draft):
        speculative sampling's rule for a drafter sure of its guess (prompt lookup). Each token takes one draw
        from the generator whether or not it was guessed, so a seeded reply is the same with or without drafts."""
        token = self(logits, allowed)
        return token, token == draft

    def record(self, token) -> None:
        """Take `token` (an int, or a 0-d tensor on the device) into the state as the sequence's next output
        token. Sampling does this itself; call it only for a token chosen elsewhere. Mirostat's mu stays."""
        if not (self.penalizes_context or self.counts_output):
            return
        if isinstance(token, int):
            self._grow(token + 1)
        index = torch.as_tensor(token, device=self.device).reshape(1)
        if self.params.penalty_decay != 1.0:
            self.counts.mul_(self.params.penalty_decay)  # Ai00: old occurrences fade
        self.counts.index_add_(0, index, torch.ones(1, device=self.device))
        self.seen.index_fill_(0, index, True)

    def _grow(self, size: int) -> None:
        if size > len(self.seen):
            extra = size - len(self.seen)
            self.seen = torch.cat([self.seen, self.seen.new_zeros(extra)])
            self.counts = torch.cat([self.counts, self.counts.new_zeros(extra)])
            if self.bias is not None:
                self.bias = torch.cat([self.bias, self.bias.new_zeros(extra)])


def sample_rows(logits: torch.Tensor, samplers: Sequence[Sampler], allowed: Sequence[Optional[torch.Tensor]]
                ) -> torch.Tensor:
    """Each row's next token: logits (rows, vocab) float32 on the head's device, a Sampler and an allowed mask (or
    None) per row -> (rows,) long on the same device, IMPOSSIBLE where no token can be chosen. Each Sampler takes
    its token into its state."""
    for sampler in samplers:
        sampler._grow(logits.shape[-1])
    logits = _processed(logits, samplers, allowed)
    impossible = torch.isneginf(logits).all(dim=-1)  # (rows,)
    logits = logits.masked_fill(impossible[:, None], 0.0)  # any draw will do there: the row is refused
    tokens = logits.argmax(dim=-1)  # (rows,) every greedy row's token; the others are drawn below
    drawn = [row for row, sampler in enumerate(samplers) if not sampler.params.greedy]
    if drawn:
        _draw_rows(logits, samplers, drawn, tokens)
    for row, sampler in enumerate(samplers):
        sampler.record(tokens[row])
    return tokens.masked_fill(impossible, IMPOSSIBLE)


def _processed(logits: torch.Tensor, samplers: Sequence[Sampler], allowed: Sequence[Optional[torch.Tensor]]
               ) -> torch.Tensor:
    """Penalties, logit_bias and the allowed masks: what can move the argmax (sampling.py's steps 1-4)."""
    vocab = logits.shape[-1]
    rows = range(len(samplers))
    logits = _by_setting(logits, [row for row in rows if samplers[row].penalizes_context],
                         lambda row: samplers[row].params.repetition_penalty,
                         lambda part, penalty, members: _penalize_seen(
                             part, torch.stack([samplers[row].seen[:vocab] for row in members]), penalty))
    logits = _by_setting(logits, [row for row in rows if samplers[row].counts_output],
                         lambda row: (samplers[row].params.presence_penalty, samplers[row].params.frequency_penalty),
                         lambda part, penalties, members: apply_presence_frequency(
                             part, torch.stack([samplers[row].counts[:vocab] for row in members]), *penalties))
    biased = [row for row in rows if samplers[row].bias is not None]
    if biased:  # rows made once per request (Sampler._bias_row): no Python list becomes a tensor here
        biases = torch.stack([samplers[row].bias[:vocab] for row in biased])
        logits = _at_rows(logits, biased, lambda part: part + biases)
    masked = [row for row in rows if allowed[row] is not None]
    if masked:
        masks = torch.stack([_padded(allowed[row], vocab) for row in masked]).to(logits.device)
        logits = _at_rows(logits, masked, lambda part: apply_allowed(part, masks))
    return logits


def _draw_rows(logits: torch.Tensor, samplers: Sequence[Sampler], drawn: list[int], tokens: torch.Tensor) -> None:
    """Temperature, then Mirostat, or top_k, typical_p, top_p and min_p and a draw (steps 6-8), into `tokens`."""
    params = lambda row: samplers[row].params  # noqa: E731
    logits = _by_setting(logits, drawn, lambda row: params(row).temperature,
                         lambda part, temperature, members: apply_temperature(part, temperature))
    plain = [row for row in drawn if params(row).mirostat == 0]
    for stage, setting in ((filter_top_k, "top_k"), (filter_typical, "typical_p"), (filter_top_p, "top_p"),
                           (filter_min_p, "min_p")):
        logits = _by_setting(logits, plain, lambda row: getattr(params(row), setting),
                             lambda part, value, members, stage=stage: stage(part, value))
    probs = torch.softmax(logits, dim=-1)
    unseeded = [row for row in plain if samplers[row].generator is None]
    if unseeded:  # one draw for every row of the global generator
        index = torch.tensor(unseeded, device=logits.device)
        tokens[index] = torch.multinomial(probs[index], 1).squeeze(-1)
    for row in drawn:
        sampler = samplers[row]
        if sampler.params.mirostat:
            tokens[row] = _mirostat(logits[row], sampler)
        elif sampler.generator is not None:  # its own stream of draws: repeatable whatever runs beside it
            tokens[row] = torch.multinomial(probs[row], 1, generator=sampler.generator)[0]


def _mirostat(logits: torch.Tensor, sampler: Sampler) -> int:
    p = sampler.params
    if p.mirostat == 2:
        token, sampler.mu = mirostat_v2_step(logits, sampler.mu, p.mirostat_tau, p.mirostat_eta, sampler.generator)
    else:
        token, sampler.mu = mirostat_v1_step(logits, sampler.mu, p.mirostat_tau, p.mirostat_eta, sampler.vocab_size,
                                             sampler.generator)
    return token


def _by_setting(logits: torch.Tensor, rows: list[int], setting_of: Callable[[int], Hashable],
                stage: Callable[[torch.Tensor, object, list[int]], torch.Tensor]) -> torch.Tensor:
    """`stage(part, setting, members)` on each group of `rows` that share a setting: one call per distinct
    setting, on all of the rows when they all share it. Stages are row-wise, so a row's result is the same
    whatever rows go with it."""
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for row in rows:
        groups[setting_of(row)].append(row)
    for setting, members in groups.items():
        logits = _at_rows(logits, members, lambda part: stage(part, setting, members))
    return logits


def _at_rows(logits: torch.Tensor, rows: list[int], stage: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    if len(rows) == logits.shape[0]:  # rows are always listed in order: all of them is the whole tensor
        return stage(logits)
    index = torch.tensor(rows, device=logits.device)
    logits = logits.clone()
    logits[index] = stage(logits[index])
    return logits


def _padded(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """A grammar's mask (the tokenizer's vocab) to the logits' length: tokens past its end are not allowed."""
    mask = mask.to(torch.bool)[:vocab]
    return torch.cat([mask, mask.new_zeros(vocab - len(mask))]) if len(mask) < vocab else mask


__all__ = ["IMPOSSIBLE", "NEG_INF", "Sampler", "sample_rows"]
