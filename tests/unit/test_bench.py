"""The benchmark suite's arithmetic and report (bench/): token timings -> figures -> targets, table, JSON, plot,
a block server's memory budget, the command line, models of named shapes and the decode rounds of a span
alone. No process is started: the suite itself is `python -m bench`."""

import json
import math
import os
import subprocess

import pytest
import torch

from bench import memory as bench_memory
from bench.memory import process_memory, reset_peaks, server_budget
from bench.options import parse_options, parse_round_options
from bench.report import decode_round_lines, plot, table, targets, write_json
from bench.shapes import SHAPES, shape_folder, shrink_bpe
from bench.span_round import MAX_REPEATS, measure_decode_rounds, prefill_lengths
from bench.stats import TokenStream, percentile, summarize_concurrent, summarize_runs
from swarm.server.span import load_span
from swarm.weights import load_config, load_tensors, load_tokenizer
from tiny_model import build_tiny_model, build_tokenizer


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


# --------------------------------------------------------------------------------- GPU runs, shapes, decode rounds


def with_decode_rounds(results: dict, tiny_ms: dict, device: str = "cpu") -> dict:
    variant = results["variants"]["float32"]
    variant["device"] = device
    variant["decode_rounds"] = {name: {"blocks": "0:4", "repeats": 5, "ms_per_round": ms,
                                       "ratio_most_to_one": ms["64"] / ms["1"]}
                                for name, ms in (("tiny", tiny_ms), ("tinyllama-1.1b", {"1": 40.0, "64": 400.0}))}
    return results


def test_the_decode_round_target_is_the_tiny_model_64_sessions_against_1(tmp_path):
    results = with_decode_rounds(results_with(20.0, 25.0, True), {"1": 2.0, "8": 2.5, "32": 4.0, "64": 5.0})
    found = targets(results["variants"]["float32"])
    assert found[-1].name.startswith("one decode round of 64 sessions vs 1, the tiny model's span alone")
    assert found[-1].ratio == pytest.approx(2.5) and found[-1].verdict == "PASS"  # the shape's 10x is no target
    results["variants"]["float32"]["decode_rounds"]["tiny"]["ms_per_round"]["64"] = 7.0
    assert targets(results["variants"]["float32"])[-1].verdict == "FAIL"
    text = table(results)
    assert "one round of the span alone" in text and "tinyllama-1.1b" in text and "10.00x" in text
    assert "PASS  one decode round" not in text and "FAIL  one decode round of 64 sessions" in text
    del results["variants"]["float32"]["decode_rounds"]["tiny"]["ms_per_round"]["64"]
    assert targets(results["variants"]["float32"])[-1].verdict == "n/a"  # 64 sessions not measured


def test_on_a_gpu_a_server_is_judged_by_its_gpu_memory(tmp_path):
    results = with_decode_rounds(results_with(20.0, 25.0, True), {"1": 2.0, "64": 5.0}, device="cuda")
    variant = results["variants"]["float32"]
    variant["memory"][0]["after_concurrency"] = {**variant["memory"][0]["after_concurrency"], "gpu": 1200}
    memory_target = next(target for target in targets(variant) if "block server" in target.name)
    assert "GPU memory" in memory_target.name and memory_target.ratio == pytest.approx(1.5)  # 1200 / (700 + 100)
    assert memory_target.verdict == "FAIL"
    results["device"] = "cuda"
    results["variants"]["float16"] = results["variants"]["float32"]
    assert "on cuda" in table(results)
    plot(results, tmp_path / "gpu.png")  # float16 has a style of its own
    assert (tmp_path / "gpu.png").read_bytes()[:4] == b"\x89PNG"


def test_on_a_gpu_a_server_is_judged_against_what_it_announces_it_needs():
    """Its ready line's GPU memory (weights, cache, graphs captured ahead, CUDA context) is the budget."""
    from bench.suite import announced_gpu_bytes

    line = ("ready: blocks 0:11 of tinyllama as peer Qm1, bfloat16 (1000 MiB of weights) on cuda:0, 1.0 tokens/s, "
            "cache 32768 tokens, 210 CUDA graphs of its rounds captured in 6.1 s, holding 300 MiB, GPU memory "
            "2.50 GiB (weights 0.98, cache 0.35, graphs 0.29, context 0.88)")
    assert announced_gpu_bytes(line) == int(2.5 * 2**30) and announced_gpu_bytes("ready: ... on cpu") is None
    results = with_decode_rounds(results_with(20.0, 25.0, True), {"1": 2.0, "64": 5.0}, device="cuda")
    variant = results["variants"]["float32"]
    variant["memory"][0]["after_concurrency"] = {**variant["memory"][0]["after_concurrency"], "gpu": 1200}
    variant["memory"][0]["announced_gpu_bytes"] = 1000
    memory_target = next(target for target in targets(variant) if "block server" in target.name)
    assert "what it announces it needs" in memory_target.name and memory_target.ratio == pytest.approx(1.2)
    assert memory_target.verdict == "PASS"


def test_gpu_memory_is_nvidia_smi_s_figure_for_the_process(monkeypatch):
    listing = "4242, 1536\n77, 10\n"
    monkeypatch.setattr(bench_memory.subprocess, "run",
                        lambda *args, **kwargs: subprocess.CompletedProcess(args, 0, stdout=listing))
    assert bench_memory.gpu_memory(4242) == 1536 * 1024 * 1024
    assert bench_memory.gpu_memory(1) is None

    def no_nvidia_smi(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(bench_memory.subprocess, "run", no_nvidia_smi)
    assert bench_memory.gpu_memory(4242) is None


def test_the_command_line_defaults_per_device(monkeypatch):
    options, _ = parse_options(["--quick"])
    assert (options.device, options.dtypes, options.concurrency) == ("cpu", ("float32",), (1, 4))
    assert options.round_sessions == (1, 8, 32, 64) and options.shape is None
    options, _ = parse_options(["--bfloat16", "--shape", "tinyllama-1.1b", "--concurrency", "8,1,8"])
    assert options.dtypes == ("float32", "bfloat16") and options.shape == "tinyllama-1.1b"
    assert options.concurrency == (1, 8) and options.tokens == 128
    assert parse_options(["--dtype", "float16,bfloat16"])[0].dtypes == ("float16", "bfloat16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a GPU machine answers
    options, _ = parse_options(["--device", "cuda"])
    assert (options.dtypes, options.concurrency) == (("bfloat16",), (1, 8, 32, 64))
    assert parse_options(["--device", "cuda", "--quick"])[0].concurrency == (1, 8)
    rounds = parse_round_options(["--device", "cuda", "--shape", "llama-3-8b", "--round-sessions", "1,64"])
    assert (rounds.dtypes, rounds.shape, rounds.round_sessions) == (("bfloat16",), "llama-3-8b", (1, 64))


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float8"], "--dtype: expected some of float32, bfloat16, float16"),
    (["--shape", "gpt-5"], "--shape: invalid choice"),
    (["--round-sessions", "1,128"], "at most 64 sessions per round"),
    (["--concurrency", "0,4"], "every count of sessions must be at least 1"),
])
def test_a_bad_flag_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_options(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line(capsys):
    with pytest.raises(SystemExit):
        parse_options(["--device", "cuda"])
    assert "cuda asked for, but CUDA is not available on this machine" in capsys.readouterr().err


def test_a_tokenizer_cut_down_to_a_smaller_vocabulary_still_encodes_everything(tmp_path):
    build_tokenizer().save_pretrained(tmp_path)  # a few hundred tokens, byte-level BPE
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps(shrink_bpe(spec, 300)))
    tokenizer = load_tokenizer(tmp_path)
    assert len(tokenizer) == 300
    text = "A swarm of block servers answers every step. Привет! 🙂"
    ids = tokenizer(text)["input_ids"]
    assert max(ids) < 300 and tokenizer.decode(ids) == text


@pytest.fixture(scope="module")
def tokenizer_source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(folder)  # stands in for the default model's (a few hundred tokens)
    return folder


def test_a_shape_is_built_once_with_random_weights_and_a_fitting_tokenizer(tmp_path, tokenizer_source, monkeypatch):
    monkeypatch.setitem(SHAPES, "tiny-wide", {**SHAPES["tiny"], "vocab_size": 600, "rope_theta": 500000.0})
    folder = shape_folder("tiny-wide", "bfloat16", tmp_path, tokenizer_source=tokenizer_source)
    assert folder == tmp_path / "bench-shapes" / "tiny-wide-bfloat16"
    config, tokenizer = load_config(folder), load_tokenizer(folder)
    shape = (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads, config.vocab_size)
    assert shape == (4, 64, 2, 600)
    assert config.rope_parameters["rope_theta"] == 500000.0 and not config.tie_word_embeddings
    head = load_tensors(folder, lambda name: name == "lm_head.weight")["lm_head.weight"]
    words = len(tokenizer)  # under 600: the tokenizer is kept as it is
    assert head.dtype == torch.bfloat16 and head[:words].abs().sum() > 0
    # past the tokenizer's tokens, and the end of sequence: never the likeliest, so never picked
    assert head[words:].abs().sum() == 0 and head[tokenizer.eos_token_id].abs().sum() == 0
    built = (folder / "model.safetensors").stat().st_mtime_ns
    assert shape_folder("tiny-wide", "bfloat16", tmp_path) == folder  # the second time: nothing is rebuilt
    assert (folder / "model.safetensors").stat().st_mtime_ns == built

    small = shape_folder("tiny", "float32", tmp_path, tokenizer_source=tokenizer_source)  # vocab 512: as is
    assert len(load_tokenizer(small)) == words


def test_decode_rounds_of_a_span_alone(tmp_path, tokenizer_source):
    lengths = prefill_lengths(64)
    assert len(set(lengths)) == 64 and min(lengths) == 8
    assert abs(sum(lengths[:8]) / 8 - sum(lengths) / 64) < 8  # any first N sessions: about the mean length
    folder = shape_folder("tiny", "float32", tmp_path, tokenizer_source=tokenizer_source)
    rounds = measure_decode_rounds(folder, sessions=(1, 8), repeats=2, warmup=1, min_seconds=0.0, drafts=(4,))
    assert rounds["blocks"] == "0:4" and rounds["most_sessions"] == 8
    assert set(rounds["ms_per_round"]) == {"1", "8"}
    assert all(len(runs) == 2 for runs in rounds["ms_per_round_runs"].values())
    assert rounds["ratio_most_to_one"] == pytest.approx(rounds["ms_per_round"]["8"] / rounds["ms_per_round"]["1"])
    # decode and verify rounds, eager and through the span's graphs (on a CPU: their padded rounds, eagerly),
    # each kind's timed rounds counted by the path they took
    assert list(rounds["kinds"]) == ["decode eager", "decode graphed", "verify 1+4 eager", "verify 1+4 graphed"]
    assert rounds["kinds"]["decode eager"]["ms_per_round"] == rounds["ms_per_round"] and not rounds["captured"]
    for name, kind in rounds["kinds"].items():
        assert set(kind["ms_per_round"]) == {"1", "8"} and kind["repeats"] == 2
        if name.endswith("graphed"):
            assert kind["graph_rounds"] == 4 and kind["eager_rounds"] == {}  # 2 counts x 2 repeats
        else:
            assert kind["graph_rounds"] == 0 and kind["eager_rounds"] == {"no graphs": 4}
    assert "verify 1+4 graphed" in "\n".join(decode_round_lines({"tiny": rounds}))
    # cheap rounds go on until enough time was measured, or MAX_REPEATS of them (a fast machine's tiny rounds)
    longer = measure_decode_rounds(folder, sessions=(1,), repeats=1, warmup=0, min_seconds=0.3, drafts=())
    runs = [run for kind in longer["kinds"].values() for run in kind["ms_per_round_runs"]["1"]]
    assert (sum(runs) >= 600 or len(runs) == 2 * MAX_REPEATS) and len(runs) > 2 and longer["repeats"] > 1
