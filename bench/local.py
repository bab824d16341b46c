"""The baseline: the whole model in this process, run by transformers itself, on the run's device.

Token arrival times come from a streamer that transformers' `generate` calls once per new token, so local
figures are derived from the same kind of TokenStream as the remote ones.
"""

from __future__ import annotations

import time

import torch

from bench.stats import TokenStream


class _ArrivalClock:
    """A transformers streamer that only notes when each new token is ready (the first `put` is the prompt)."""

    def __init__(self, stream: TokenStream):
        self.stream, self.prompt_seen = stream, False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if value.is_cuda:  # a token on the GPU is ready once the GPU has computed it, not when it was queued
            torch.cuda.synchronize(value.device)
        # one token per call, or a verified draft's tokens together (prompt lookup)
        self.stream.arrivals += [time.perf_counter()] * value.numel()

    def end(self) -> None:
        pass


class LocalModel:
    def __init__(self, folder, dtype: torch.dtype, device: str = "cpu"):
        import transformers

        self.device = torch.device(device)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(self.device).eval()

    @torch.inference_mode()
    def generate(self, ids: list[int], max_new_tokens: int, speculative_tokens: int = 0) -> TokenStream:
        """Greedy, up to max_new_tokens, stopping at end of sequence like the swarm does (so both do the same work);
        with `speculative_tokens`, transformers' prompt lookup drafts up to that many tokens a step, as the
        gateway's speculation drafts (the same tokens come out)."""
        stream = TokenStream(sent=time.perf_counter())
        drafts = {"prompt_lookup_num_tokens": speculative_tokens} if speculative_tokens else {}
        self.model.generate(torch.tensor([ids], device=self.device), max_new_tokens=max_new_tokens, do_sample=False,
                            streamer=_ArrivalClock(stream), **drafts)
        return stream

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> TokenStream:
        """One forward pass over the prompt and the first token picked from it: local time to first token.
        Logits for the last position only, as generate's prefill and the gateway both compute them."""
        stream = TokenStream(sent=time.perf_counter())
        logits = self.model(torch.tensor([ids], device=self.device), logits_to_keep=1).logits
        int(logits[0, -1].argmax())  # on a GPU, waits for the pass to finish
        stream.arrivals.append(time.perf_counter())
        return stream
