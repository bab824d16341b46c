"""Speed of recent requests: prefill (the prompt's first step) and decode (every step after it).

MLC-Chat's /stats and /verbose_stats read them; the OpenAI API's usage carries mistral.rs's timing extras. Each
request's figures are its caller's (CALLER, which the web layer sets for every request: web/access.py), and a caller
sees only its own: another's prompt lengths and timings are theirs.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from contextvars import ContextVar
from dataclasses import dataclass, field

# who is calling in this thread now (access.client_id: a key's fingerprint, or an address); "" outside requests
CALLER: ContextVar[str] = ContextVar("stats_caller", default="")


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    caller: str = field(default_factory=CALLER.get)
    _step_began: float = field(default_factory=time.perf_counter)

    def prompt(self, tokens: int) -> None:
        """A generation starts: its first step will carry these many prompt tokens."""
        self.prompt_tokens += tokens
        self._step_began = time.perf_counter()

    def step_done(self, first: bool) -> float:
        """A token came out of a step: return the seconds since the last one (or since the prompt, if first)."""
        now = time.perf_counter()
        seconds, self._step_began = now - self._step_began, now
        if first:
            self.prefill_seconds += seconds
        else:
            self.decode_seconds += seconds
        self.completion_tokens += 1
        return seconds

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decoded = self.completion_tokens - 1  # the first token came out of the prefill step
        return decoded / self.decode_seconds if self.decode_seconds and decoded > 0 else 0.0

    def timing(self) -> dict:
        """mistral.rs's usage extras."""
        total = time.perf_counter() - self.started
        return {
            "avg_tok_per_sec": round((self.prompt_tokens + self.completion_tokens) / total, 3) if total else 0.0,
            "avg_prompt_tok_per_sec": round(self.prefill_tokens_per_s, 3),
            "avg_compl_tok_per_sec": round(self.decode_tokens_per_s, 3),
            "total_time_sec": round(total, 3),
            "total_prompt_time_sec": round(self.prefill_seconds, 3),
            "total_completion_time_sec": round(self.decode_seconds, 3),
        }


    def llama_timings(self, cached_tokens: int) -> dict:
        """llama.cpp server's `timings`: the prompt tokens reused (cache_n) and computed (prompt_n), and decoding
        (predicted_*: every token generated; its time and rate after the first, which the prefill gave)."""
        return {
            "cache_n": cached_tokens,
            "prompt_n": self.prompt_tokens,
            "prompt_ms": round(self.prefill_seconds * 1000, 3),
            "prompt_per_second": round(self.prefill_tokens_per_s, 3),
            "predicted_n": self.completion_tokens,
            "predicted_ms": round(self.decode_seconds * 1000, 3),
            "predicted_per_second": round(self.decode_tokens_per_s, 3),
        }


class EngineStats:
    """The last `keep` requests of each of the `callers` most recently active callers."""

    def __init__(self, keep: int = 32, callers: int = 1024):
        self.keep, self.callers = keep, callers
        self._recent: OrderedDict[str, deque[RequestStats]] = OrderedDict()  # by caller, least recently active first
        self._lock = threading.Lock()

    def begin(self) -> RequestStats:
        stats = RequestStats()
        with self._lock:
            self._recent.setdefault(stats.caller, deque(maxlen=self.keep)).append(stats)
            self._recent.move_to_end(stats.caller)
            while len(self._recent) > self.callers:
                self._recent.popitem(last=False)
        return stats

    def _done(self) -> list[RequestStats]:
        """The current caller's finished recent requests."""
        with self._lock:
            return [stats for stats in self._recent.get(CALLER.get(), ()) if stats.completion_tokens]

    def summary(self) -> dict:
        """The caller's last finished request's speeds (MLC's /stats)."""
        done = self._done()
        last = done[-1] if done else RequestStats()
        return {"prefill_tokens_per_s": round(last.prefill_tokens_per_s, 3),
                "decode_tokens_per_s": round(last.decode_tokens_per_s, 3)}

    def verbose(self) -> dict:
        """Totals over the caller's recent requests, and the last one's detail (MLC's /verbose_stats)."""
        done = self._done()
        prompt = sum(stats.prompt_tokens for stats in done)
        completion = sum(stats.completion_tokens for stats in done)
        prefill = sum(stats.prefill_seconds for stats in done)
        decode = sum(stats.decode_seconds for stats in done)
        decoded = sum(stats.completion_tokens - 1 for stats in done)
        return {
            **self.summary(),
            "requests": len(done),
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "prefill_seconds": round(prefill, 3),
            "decode_seconds": round(decode, 3),
            "average_prefill_tokens_per_s": round(prompt / prefill, 3) if prefill else 0.0,
            "average_decode_tokens_per_s": round(decoded / decode, 3) if decode else 0.0,
        }
