"""Turning logits into text: next-token choice as pure functions, and a detokenizer that streams safely.

The gateway's sampling builds on these; `python -m swarm.client.generate` uses them as they are.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def next_token(
    logits: torch.Tensor,  # (batch, vocab)
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:  # (batch,)
    """Greedy when temperature is 0, else a sample after temperature, top-k and top-p (nucleus) filtering."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k > 0:
        logits = filter_top_k(logits, top_k)
    if top_p < 1.0:
        logits = filter_top_p(logits, top_p)
    probabilities = torch.softmax(logits, dim=-1)
    return torch.multinomial(probabilities, num_samples=1, generator=generator).squeeze(-1)


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    kth_best = torch.topk(logits, min(k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_best, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (always at least one)."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    remove = cumulative - torch.softmax(sorted_logits, dim=-1) >= p  # mass before this token already reaches p
    remove[..., 0] = False  # the likeliest token stays even when p is below what float32 tells from zero
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class IncrementalDetokenizer:
    """Text of a growing token sequence, emitted piece by piece, never splitting a UTF-8 character.

    Decodes only a short window of recent tokens each time (not the whole sequence), keeping the window's
    first tokens as context so that tokenizers that merge spaces across tokens decode correctly.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, context: Sequence[int] = ()):
        """`context`: the last few tokens before the new ones (their text was shown earlier), so that the
        first new token decodes as it would mid-sequence (SentencePiece drops a leading space otherwise)."""
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.tokens: list[int] = [int(token) for token in context]
        self.prefix_offset = 0  # start of the context window
        self.read_offset = len(self.tokens)  # tokens before this have been emitted

    def push(self, token: int) -> str:
        """Add a token; return the new text it completes (may be empty while a character is incomplete)."""
        self.tokens.append(int(token))
        decode = lambda tokens: self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens)
        emitted = decode(self.tokens[self.prefix_offset : self.read_offset])
        full = decode(self.tokens[self.prefix_offset :])
        if len(full) <= len(emitted) or full.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still waits for its remaining bytes
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return full[len(emitted) :]

    def flush(self) -> str:
        """The end of the text: whatever was held back for an incomplete character, as decode gives it."""
        decode = lambda tokens: self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens)
        emitted = decode(self.tokens[self.prefix_offset : self.read_offset])
        full = decode(self.tokens[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return full[len(emitted) :]
