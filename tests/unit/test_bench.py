"""The benchmark suite's arithmetic and report (bench/): token timings -> figures -> targets, table, JSON, plot,
and a block server's memory budget. No process is started: the suite itself is `python -m bench`."""

import json
import math
import os

import pytest
import torch

from bench.memory import process_memory, reset_peaks, server_budget
from bench.report import plot, table, targets, write_json
from bench.stats import TokenStream, percentile, summarize_concurrent, summarize_runs
from swarm.server.span import load_span
from tiny_model import build_tiny_model


def stream(sent: float, *arrivals: float, **fields) -> TokenStream:
    return TokenStream(sent=sent, arrivals=list(arrivals), **fields)


def test_percentiles_interpolate_like_numpy_and_skip_nan():
    values = [4.0, 1.0, 3.0, 2.0, math.nan]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 95) == pytest.approx(3.85)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert math.isnan(percentile([math.nan], 50))


def test_token_stream_figures():
    reply = stream(10.0, 10.5, 10.6, 10.8, 11.0)
    assert reply.ttft == pytest.approx(0.5)
    assert reply.inter_token == pytest.approx([0.1, 0.2, 0.2])
    assert reply.decode_rate == pytest.approx(3 / 0.5)  # tokens after the first, over their time
    assert reply.rate == pytest.approx(4 / 1.0)
    # an OpenAI chunk may carry several tokens: the count is the usage's
    assert stream(0.0, 1.0, 2.0, token_count=5).decode_rate == pytest.approx(4.0)
    assert math.isnan(stream(0.0, 1.0).decode_rate) and math.isnan(stream(0.0).ttft)


def test_concurrent_sessions_aggregate_over_the_wall_time():
    summary = summarize_concurrent([
        stream(0.0, 1.0, 2.0, 3.0),
        stream(0.5, 2.0, 3.0, 4.0),
        stream(math.nan, error="ReplyError: too many sessions (after 0 tokens)"),  # never started
    ])
    assert summary["tokens"] == 6 and summary["wall_s"] == 4.0 and summary["aggregate_tok_s"] == 1.5
    assert summary["ttft_p50_s"] == 1.25 and summary["itl_p50_s"] == 1.0
    assert summary["errors"] == ["ReplyError: too many sessions (after 0 tokens)"]


def results_with(ws_rate: float, local_rate: float, sixteen_sessions: bool) -> dict:
    """A run's results as bench/suite.py returns them, from made-up timings."""
    def reply(rate: float, tokens: int = 5) -> TokenStream:
        return stream(0.0, *[(index + 1) / rate for index in range(tokens)])

    single = {name: summarize_runs([reply(rate)]) for name, rate in (
        ("local_generate", local_rate), ("swarm_client", ws_rate), ("gateway_websocket", ws_rate),
        ("gateway_openai_sse", ws_rate))}
    single["local_prefill_long"] = summarize_runs([stream(0.0, 1.0)])
    single["gateway_websocket_long"] = summarize_runs([stream(0.0, 1.2)])
    counts = [1, 4, 16] if sixteen_sessions else [1, 4]
    concurrency = {str(count): summarize_concurrent([reply(10.0 * min(count, 7) / count)] * count) for count in counts}
    memory = {"server": {"rss": 900, "peak": 1000}, "p2pd": {"rss": 50, "peak": 60}}
    return {
        "model": "tiny", "started": "now", "spans": ["0:2", "2:4"], "prompt_tokens": {"chat": 42, "long": 512},
        "options": {"tokens": 5, "rounds": 1, "concurrency_tokens": 5},
        "threads": {"torch_threads_per_process": 1, "gateway": "OMP_NUM_THREADS=1"},
        "variants": {"float32": {"single_session": single, "concurrency": concurrency, "memory": [
            {"blocks": "0:2", "cache_tokens": 10, "weights_bytes": 700, "cache_budget_bytes": 100,
             "peaks_reset_after_start": True, "at_start": memory, "after_single_sessions": memory,
             "after_concurrency": memory}]}},
    }


def test_targets_judge_each_ratio_against_its_goal():
    found = targets(results_with(ws_rate=20.0, local_rate=25.0, sixteen_sessions=True)["variants"]["float32"])
    # WebSocket vs local decode, 16 sessions vs 1, long-prompt TTFT vs local prefill, server peak RSS vs budget
    assert [target.ratio for target in found] == pytest.approx([0.8, 7.0, 1.2, 1.25])
    assert [target.verdict for target in found] == ["FAIL", "PASS", "PASS", "PASS"]


def test_a_target_the_run_did_not_measure_is_not_applicable():
    variant = results_with(ws_rate=25.0, local_rate=25.0, sixteen_sessions=False)["variants"]["float32"]
    assert [target.verdict for target in targets(variant)] == ["PASS", "n/a", "PASS", "PASS"]


def test_table_json_and_plot(tmp_path):
    results = results_with(ws_rate=20.0, local_rate=25.0, sixteen_sessions=True)
    results["variants"]["float32"]["single_session"]["swarm_client"]["decode_tok_s"] = math.nan
    text = table(results)
    assert "gateway, WebSocket" in text and "FAIL  single session" in text and "PASS  16 concurrent" in text
    write_json(results, tmp_path / "run.json")  # NaN is not JSON: it is written as null
    assert json.loads((tmp_path / "run.json").read_text())["variants"]["float32"]["single_session"]["swarm_client"][
        "decode_tok_s"] is None
    plot(results, tmp_path / "run.png")
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"


def test_server_budget_counts_the_span_weights_and_its_cache(tmp_path):
    folder = build_tiny_model(tmp_path, "llama", 4)
    budget = server_budget(folder, 1, 3, cache_tokens=100, dtype=torch.bfloat16)
    span = load_span(folder, 1, 3, dtype=torch.bfloat16)
    assert budget.weights_bytes == sum(tensor.numel() * 2 for tensor in span.parameters())
    config = span.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert budget.cache_bytes == 100 * 2 * 2 * config.num_key_value_heads * head_dim * 2  # K and V, 2 blocks, bf16


def test_a_peak_starts_again_from_the_present():
    spike = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    del spike
    before = process_memory(os.getpid())
    assert reset_peaks(os.getpid())
    after = process_memory(os.getpid())
    assert after.peak < before.peak and after.rss <= after.peak
