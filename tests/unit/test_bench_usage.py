"""What `python -m bench` reads of every process over a concurrency run (bench/usage.py: servers' rows per round,
graphed and eager rounds from their metrics text, CPU per token, GPU utilisation), how it reports them, the
caps it lifts, and single sessions decoding the same way on every path (the Python client's speculation). No
swarm is started: the suite itself is `python -m bench`."""

import math
import os
import subprocess
from contextlib import contextmanager

import pytest
import torch

from bench import usage
from bench.clients import speculative_steps
from bench.gateway import bench_limits
from bench.local import _ArrivalClock
from bench.options import parse_options
from bench.report import round_path, speculation_line, table
from bench.stats import TokenStream, summarize_concurrent
from bench.suite import server_limits
from bench.usage import GpuSampler, RoundCounters, UsageWindow, Watched, cpu_ms_per_token, parse_metrics, server_window
from test_bench import results_with

# what a block server's /metrics says (prometheus_client's text), trimmed to the lines that matter and a few others
METRICS = """# HELP swarm_server_batch_size Sequences in one forward pass through the span
# TYPE swarm_server_batch_size histogram
swarm_server_batch_size_bucket{{le="1.0"}} 3.0
swarm_server_batch_size_bucket{{le="+Inf"}} {rounds}
swarm_server_batch_size_count {rounds}
swarm_server_batch_size_sum {rows}
swarm_server_batch_size_created 1.7e+09
# HELP swarm_server_graph_rounds_total Compute rounds that replayed a captured CUDA graph
# TYPE swarm_server_graph_rounds_total counter
swarm_server_graph_rounds_total {graphed}
swarm_server_graph_rounds_created 1.7e+09
# HELP swarm_server_eager_rounds_total Compute rounds run eagerly (kernel by kernel), by reason
# TYPE swarm_server_eager_rounds_total counter
swarm_server_eager_rounds_total{{reason="prefill"}} {prefill}
swarm_server_eager_rounds_created{{reason="prefill"}} 1.7e+09
swarm_server_eager_rounds_total{{reason="no graphs"}} {no_graphs}
# HELP swarm_server_open_sessions Inference sessions open on this server
# TYPE swarm_server_open_sessions gauge
swarm_server_open_sessions 64.0
"""


def metrics_text(rounds, rows, graphed, prefill, no_graphs=0.0) -> str:
    return METRICS.format(rounds=rounds, rows=rows, graphed=graphed, prefill=prefill, no_graphs=no_graphs)


def test_rows_per_round_and_rounds_by_path_come_from_two_scrapes():
    before = parse_metrics(metrics_text(rounds=10.0, rows=40.0, graphed=2.0, prefill=8.0))
    assert before == RoundCounters(rows=40.0, rounds=10.0, graph_rounds=2.0,
                                   eager_rounds={"prefill": 8.0, "no graphs": 0.0})
    after = parse_metrics(metrics_text(rounds=110.0, rows=5040.0, graphed=92.0, prefill=18.0))
    window = server_window(before, after)
    # 100 rounds carried 5000 sequences; 90 of them replayed a graph, 10 were prefill chunks
    assert window == {"rounds": 100.0, "rows_per_round": 50.0, "graph_rounds": 90.0,
                      "eager_rounds": {"prefill": 10.0}}
    assert server_window(after, after)["eager_rounds"] == {}  # none: reported as none, not as unknown


def test_a_server_without_the_new_counters_reports_them_as_unknown():
    older = "\n".join(line for line in metrics_text(10.0, 40.0, 0.0, 0.0).splitlines()
                      if "graph_rounds" not in line and "eager_rounds" not in line)
    window = server_window(parse_metrics(older), parse_metrics(older.replace(" 40.0", " 60.0").replace(" 10.0", " 15.0")))
    assert window == {"rounds": 5.0, "rows_per_round": 4.0, "graph_rounds": None, "eager_rounds": None}
    unanswered = server_window(None, parse_metrics(older))  # the first scrape failed: nothing is made up
    assert unanswered["rounds"] is None and math.isnan(unanswered["rows_per_round"])
    assert math.isnan(server_window(parse_metrics(older), parse_metrics(older))["rows_per_round"])  # no round


def test_cpu_per_token_is_each_part_s_time_over_the_window_s_tokens():
    before, after = {"own": 1.0, "p2pd": 0.5}, {"own": 1.3, "p2pd": 0.52}
    assert cpu_ms_per_token(before, after, tokens=4096) == pytest.approx({"own": 300 / 4096, "p2pd": 20 / 4096})
    assert math.isnan(cpu_ms_per_token(before, after, tokens=0)["own"])
    assert cpu_ms_per_token(before, {"own": 0.9}, tokens=10) == {"own": 0.0, "p2pd": 0.0}  # a process gone
    spent = usage.cpu_seconds(os.getpid())
    assert spent["own"] > 0 and set(spent) == {"own", "p2pd"}
    assert usage.cpu_seconds(2 ** 22 + 12345) == {"own": 0.0, "p2pd": 0.0}  # no such process


def test_gpu_utilisation_is_nvidia_smi_s_figure_or_not_reported(monkeypatch):
    monkeypatch.setattr(usage.subprocess, "run",
                        lambda *args, **kwargs: subprocess.CompletedProcess(args, 0, stdout="30\n50\n"))
    assert usage.gpu_busy_percent() == 40.0  # two GPUs: their mean

    def no_nvidia_smi(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(usage.subprocess, "run", no_nvidia_smi)
    assert usage.gpu_busy_percent() is None
    figures = iter([20.0, 60.0, 40.0])
    sampler = GpuSampler(period=0.001, query=lambda: next(figures, None)).start()
    sampler._thread.join()  # it stops by itself once the query has no answer
    assert sampler.stop() == {"mean_percent": 40.0, "max_percent": 60.0, "samples": 3}
    assert GpuSampler(query=lambda: None).start().stop() is None


def test_a_window_reads_every_server_and_process_before_and_after(monkeypatch):
    scrapes = iter([metrics_text(0.0, 0.0, 0.0, 0.0), metrics_text(64.0, 3072.0, 60.0, 4.0)])
    monkeypatch.setattr(usage, "scrape", lambda url: parse_metrics(next(scrapes)))
    watched = Watched({"server 0:2": "http://127.0.0.1:1/metrics"}, {"gateway": os.getpid()}, gpu=False)
    with UsageWindow(watched) as window:
        sum(range(10 ** 6))  # some CPU time of this process's
    result = window.result(tokens=1000)
    assert result["servers"]["server 0:2"]["rows_per_round"] == 48.0
    assert result["servers"]["server 0:2"]["eager_rounds"] == {"prefill": 4.0}
    assert result["cpu_ms_per_token"]["gateway"]["own"] > 0 and result["gpu_utilisation"] is None


def test_the_report_shows_each_process_over_each_run():
    results = results_with(ws_rate=20.0, local_rate=25.0, sixteen_sessions=True)
    results["options"]["speculative_tokens"] = 0
    run = results["variants"]["float32"]["concurrency"]["16"]
    run["usage"] = {"tokens": 80, "gpu_utilisation": None,
                    "servers": {"server 0:2": {"rounds": 20.0, "rows_per_round": 12.5, "graph_rounds": None,
                                               "eager_rounds": {"no graphs": 18.0, "prefill": 2.0}},
                                "server 2:4": {"rounds": 20.0, "rows_per_round": 12.5, "graph_rounds": 20.0,
                                               "eager_rounds": {}}},
                    "cpu_ms_per_token": {"gateway": {"own": 1.25, "p2pd": 0.02},
                                         "server 0:2": {"own": 0.7, "p2pd": 0.01},
                                         "server 2:4": {"own": 0.6, "p2pd": 0.01}}}
    lines = table(results).splitlines()
    first = next(line for line in lines if "server 0:2" in line and "rows" not in line)
    assert first.split()[:5] == ["16", "server", "0:2", "12.5", "20"]
    assert " - " in first and "0.70" in first and first.endswith("no graphs 18, prefill 2")
    assert next(line for line in lines if "server 2:4" in line).endswith("none")  # every round replayed a graph
    assert "1.25" in next(line for line in lines if line.split()[:2] == ["16", "gateway"])
    assert any("speculation: off on every path" in line for line in lines)
    assert not any("GPU busy" in line for line in lines)  # a CPU run
    results["variants"]["float32"]["device"] = "cuda"
    assert "16 GPU busy: not reported (no nvidia-smi)" in table(results)


def test_a_round_s_path_and_the_speculation_line():
    assert round_path({"graph_rounds": 30.0, "eager_rounds": {}}, captured=True) == "graphs 30/30"
    assert round_path({"graph_rounds": 30.0, "eager_rounds": {}}, captured=False) == "padded 30/30"
    assert round_path({"graph_rounds": 0.0, "eager_rounds": {"prefill": 30.0}}, captured=True) \
        == "eager 30/30 (prefill 30)"
    assert round_path({"ms_per_round": {}}, captured=True) == ""  # results that did not count them
    assert speculation_line(None) == [] and "SPECULATIVE_TOKENS=8" in speculation_line(8)[0]


def test_every_cap_the_benched_sessions_meet_is_lifted():
    limits = bench_limits(68)
    assert limits["MAX_SESSIONS"] == limits["MAX_SESSIONS_PER_CLIENT"] == limits["MAX_WEBSOCKETS_PER_CLIENT"] == "68"
    assert int(limits["MAX_WEBSOCKETS"]) >= 68 and limits["REQUESTS_PER_MINUTE"] == "0"
    assert bench_limits(2000)["MAX_WEBSOCKETS"] == "2000"
    assert server_limits(68) == ["--max-sessions-per-peer", "256"]  # the servers' default already holds them
    assert server_limits(300) == ["--max-sessions-per-peer", "300"]


def test_speculation_is_set_once_for_every_path():
    options, _ = parse_options(["--quick"])
    assert options.speculative_tokens == 0 and options.round_drafts == (4, 8)
    options, _ = parse_options(["--speculative-tokens", "8", "--round-drafts", "8,2"])
    assert options.speculative_tokens == 8 and options.round_drafts == (2, 8)


# --------------------------------------------------------------------------------- the Python client's speculation


class CountingModel:
    """A stand-in RemoteModel: its next token after t is NEXT[t] (a cycle, so replies copy themselves and prompt
    lookup finds drafts); it records the positions each step carried."""

    VOCAB, STOP = 16, 15
    NEXT = {token: (token + 1) % 7 for token in range(15)}  # 0 1 2 ... 6 0 1 ...

    def __init__(self):
        self.stop_token_ids, self.steps = frozenset({self.STOP}), []

    @contextmanager
    def session(self, max_length: int):
        model, history = self, []

        class Session:
            def step(self, token_ids, position=None, every_position=False):
                tokens = list(token_ids[0])
                start = len(history) if position is None else position
                assert start <= len(history) and start + len(tokens) <= max_length
                history[start:] = tokens  # a position below the length rewinds the session
                model.steps.append(len(tokens))
                logits = torch.zeros(len(tokens), model.VOCAB)
                logits[torch.arange(len(tokens)), [model.NEXT[token] for token in tokens]] = 1.0
                return logits[None] if every_position else logits[-1:]

        yield Session()


def test_the_python_client_speculates_as_the_gateway_and_replies_the_same():
    from swarm.client.generate import generate

    plain_model, speculating = CountingModel(), CountingModel()
    prompt = [3, 4, 5, 6, 0, 1, 2, 3]
    plain = list(generate(plain_model, prompt, 20))
    steps = list(speculative_steps(speculating, prompt, 20, most=8))
    assert [token for step in steps for token in step] == plain and len(plain) == 20
    assert max(speculating.steps[1:]) > 1  # drafts were sent with the pending token
    assert len(speculating.steps) < len(plain_model.steps)  # fewer round trips for the same tokens


def test_a_speculating_reply_ends_at_a_stop_token():
    model = CountingModel()
    model.NEXT = {**CountingModel.NEXT, 2: CountingModel.STOP}  # ... 0 1 2 then the stop token
    steps = list(speculative_steps(model, [0, 1, 2, 3, 4, 5, 6, 0], 20, most=4))
    assert [token for step in steps for token in step] == [1, 2]


def test_local_arrivals_count_every_token_of_a_verified_draft():
    stream = TokenStream(sent=0.0)
    clock = _ArrivalClock(stream)
    clock.put(torch.tensor([[1, 2, 3]]))  # the prompt
    clock.put(torch.tensor([4]))
    clock.put(torch.tensor([[5, 6, 7]]))  # a draft's three tokens, kept together
    assert stream.tokens == 4 and summarize_concurrent([stream])["tokens"] == 4
