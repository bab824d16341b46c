"""Token arrival times -> time to first token, inter-token latency and tokens per second; percentiles.

Every measurement of the suite, local or remote, is a TokenStream: when the request left and when each
token arrived, on one clock (time.perf_counter). All figures derive from those times in one way, so a
local run and a run through the gateway are compared like for like.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

NAN = float("nan")


@dataclass
class TokenStream:
    """One request: when it was sent, and when each piece of its reply arrived."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    # tokens in the reply, when a piece may carry several (an OpenAI chunk); None: one token per arrival
    token_count: Optional[int] = None
    error: Optional[str] = None  # why the reply stopped early (a timeout, an error frame); None when complete

    @property
    def tokens(self) -> int:
        return len(self.arrivals) if self.token_count is None else self.token_count

    @property
    def ttft(self) -> float:
        """Time to first token: sending the request to the first token's arrival (prefill included)."""
        return self.arrivals[0] - self.sent if self.arrivals else NAN

    @property
    def inter_token(self) -> list[float]:
        """Gaps between consecutive arrivals."""
        return [later - earlier for earlier, later in zip(self.arrivals, self.arrivals[1:])]

    @property
    def decode_rate(self) -> float:
        """Tokens per second after the first token: decoding alone, without the prompt's prefill."""
        if len(self.arrivals) < 2 or self.tokens < 2:
            return NAN
        return (self.tokens - 1) / (self.arrivals[-1] - self.arrivals[0])

    @property
    def rate(self) -> float:
        """Tokens per second from sending the request to the last token (prefill included)."""
        return self.tokens / (self.arrivals[-1] - self.sent) if self.arrivals else NAN


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linearly interpolated between the closest ranks (numpy's default);
    NaNs are left out, and nothing left gives NaN."""
    ordered = sorted(value for value in values if not math.isnan(value))
    if not ordered:
        return NAN
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def summarize_runs(streams: Sequence[TokenStream]) -> dict:
    """Repeated runs of one single-session measurement: medians across runs, latency percentiles across all
    of their tokens."""
    gaps = [gap for stream in streams for gap in stream.inter_token]
    return {
        "runs": len(streams),
        "tokens": [stream.tokens for stream in streams],
        "decode_tok_s": median([stream.decode_rate for stream in streams]),
        "end_to_end_tok_s": median([stream.rate for stream in streams]),
        "ttft_s": median([stream.ttft for stream in streams]),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p95_s": percentile(gaps, 95),
        "decode_tok_s_runs": [stream.decode_rate for stream in streams],
        "ttft_s_runs": [stream.ttft for stream in streams],
        "errors": [stream.error for stream in streams if stream.error],
    }


def summarize_concurrent(streams: Sequence[TokenStream]) -> dict:
    """Sessions that ran at the same time: aggregate throughput over the whole wall time, per-session
    figures and latency percentiles across sessions (TTFT) and across every token of every session (ITL)."""
    started = [stream for stream in streams if stream.arrivals]
    wall = max(stream.arrivals[-1] for stream in started) - min(stream.sent for stream in started) if started else NAN
    ttfts = [stream.ttft for stream in streams]
    gaps = [gap for stream in streams for gap in stream.inter_token]
    total = sum(stream.tokens for stream in streams)
    return {
        "sessions": len(streams),
        "tokens": total,
        "wall_s": wall,
        "aggregate_tok_s": total / wall if started else NAN,
        "per_session_tok_s_p50": median([stream.rate for stream in streams]),
        "per_session_decode_tok_s_p50": median([stream.decode_rate for stream in streams]),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p95_s": percentile(gaps, 95),
        "errors": [stream.error for stream in streams if stream.error],
    }
