"""The engine's Prometheus metrics: how fast tokens come, per model (served at /metrics by web/metrics.py).

    gateway_time_to_first_token_seconds{model}  histogram  from a generation's start to its first token
    gateway_inter_token_latency_seconds{model}  histogram  between two tokens of one generation
    gateway_generated_tokens_total{model}       counter    rate() of it is the gateway's tokens/s
    gateway_cached_prompt_tokens_total{model}   counter    prompt tokens the servers held already (engine/warm.py)
    gateway_draft_tokens_total{model}           counter    tokens drafted and sent for verification (speculation.py)
    gateway_draft_tokens_accepted_total{model}  counter    of those, the ones kept: their ratio is the acceptance rate
    gateway_engine_ticks_total{model}           counter    engine loop ticks that computed something (loop.py)
    gateway_engine_rows_total{model}            counter    logits rows sampled: rows / ticks is the loop's batch
    gateway_engine_steps_total{model}           counter    chain steps started: steps / ticks, sessions sent together
    gateway_aborted_replies_total{model}        counter    replies their reader ended (stop sequence, client gone, stop)
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

TIME_TO_FIRST_TOKEN = Histogram("gateway_time_to_first_token_seconds",
                                "From the start of a generation (prompt sent) to its first token", ["model"],
                                buckets=_LATENCY_BUCKETS)
INTER_TOKEN_LATENCY = Histogram("gateway_inter_token_latency_seconds", "Between two tokens of one generation",
                                ["model"], buckets=_LATENCY_BUCKETS)
GENERATED_TOKENS = Counter("gateway_generated_tokens_total", "Tokens generated (rate() gives tokens/s)", ["model"])
CACHED_PROMPT_TOKENS = Counter("gateway_cached_prompt_tokens_total",
                               "Prompt tokens the servers held already from an earlier request: never computed again",
                               ["model"])

DRAFT_TOKENS = Counter("gateway_draft_tokens", "Tokens drafted (speculative decoding) and verified by the swarm", ["model"])
ACCEPTED_DRAFT_TOKENS = Counter("gateway_draft_tokens_accepted",
                                "Drafted tokens that were the model's choice: kept without a step of their own", ["model"])

ENGINE_TICKS = Counter("gateway_engine_ticks", "Engine loop ticks that computed something", ["model"])
ENGINE_ROWS = Counter("gateway_engine_rows", "Logits rows the engine loop sampled (rows per tick: its batch)", ["model"])
ABORTED_REPLIES = Counter("gateway_aborted_replies",
                          "Replies their reader ended: a stop sequence, a client gone, a stop message", ["model"])
ENGINE_STEPS = Counter("gateway_engine_steps", "Chain steps the engine loop started", ["model"])


def observe_token(model: str, seconds: float, first: bool) -> None:
    """One generated token: `seconds` since the generation started (the first) or since the token before."""
    (TIME_TO_FIRST_TOKEN if first else INTER_TOKEN_LATENCY).labels(model).observe(seconds)
    GENERATED_TOKENS.labels(model).inc()
