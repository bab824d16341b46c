"""What a run's results (bench/suite.py) become: the targets with PASS or FAIL, a table, JSON and a plot."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

MB = 1024 * 1024


# ------------------------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    name: str
    ratio: float  # NaN when the run did not measure it (e.g. --quick has no 16-session run)
    goal: float
    at_least: bool  # True: ratio >= goal passes (throughput); False: ratio <= goal passes (latency, memory)

    @property
    def verdict(self) -> str:
        if math.isnan(self.ratio):
            return "n/a"
        return "PASS" if (self.ratio >= self.goal if self.at_least else self.ratio <= self.goal) else "FAIL"

    def as_dict(self) -> dict:
        return {"name": self.name, "ratio": self.ratio, "goal": self.goal,
                "compare": ">=" if self.at_least else "<=", "verdict": self.verdict}

    def describe(self) -> str:
        sign = ">=" if self.at_least else "<="
        figure = "not measured in this run" if math.isnan(self.ratio) else f"{self.ratio:.2f}x"
        return f"{self.verdict:4s}  {self.name}: {figure} (target {sign} {self.goal}x)"


def targets(variant: dict) -> list[Target]:
    """The issue's targets, as ratios of figures of one dtype's run, and the decode rounds' when it has them."""
    single, concurrency = variant["single_session"], variant["concurrency"]
    one, sixteen = concurrency.get("1"), concurrency.get("16")
    found = [
        Target("single session, gateway WebSocket decode tok/s vs local transformers generate",
               _ratio(single["gateway_websocket"]["decode_tok_s"], single["local_generate"]["decode_tok_s"]),
               1.0, at_least=True),
        Target("16 concurrent sessions, aggregate tok/s vs 1 session",
               _ratio(sixteen["aggregate_tok_s"], one["aggregate_tok_s"]) if one and sixteen else math.nan,
               6.0, at_least=True),
        Target("TTFT of the long prompt through the gateway vs local prefill",
               _ratio(single["gateway_websocket_long"]["ttft_s"], single["local_prefill_long"]["ttft_s"]),
               1.3, at_least=False),
    ]
    found += [_memory_target(server, variant.get("device", "cpu")) for server in variant["memory"]]
    if variant.get("decode_rounds"):
        found.append(decode_round_target(variant["decode_rounds"], variant.get("device", "cpu")))
    return found


def _memory_target(server: dict, device: str) -> Target:
    """On a CPU a server's peak RSS, against its blocks' weights plus its cache budget; on a GPU its GPU memory,
    against what the server says it needs there (weights, cache, graphs captured ahead and the CUDA context)."""
    budget = server["weights_bytes"] + server["cache_budget_bytes"]
    if device == "cpu":
        used, what, against = server["after_concurrency"]["server"]["peak"], "peak RSS", "its weights + cache budget"
    else:
        used, what = server["after_concurrency"].get("gpu") or math.nan, "GPU memory"
        budget, against = server.get("announced_gpu_bytes") or budget, "what it announces it needs"
    return Target(f"block server {server['blocks']} {what} while serving vs {against}", _ratio(used, budget), 1.3,
                  at_least=False)


ROUND_GOAL = 3.0  # a decode round of 64 sessions may cost at most 3x one of a single session (tiny model)


def decode_round_target(rounds: dict, device: str) -> Target:
    """One decode round of the tiny model's span alone: 64 sessions against 1."""
    tiny = rounds.get("tiny", {}).get("ms_per_round", {})
    return Target(f"one decode round of 64 sessions vs 1, the tiny model's span alone on {device}",
                  _ratio(tiny.get("64", math.nan), tiny.get("1", math.nan)), ROUND_GOAL, at_least=False)


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator and not math.isnan(denominator) else math.nan


# ------------------------------------------------------------------------------------------- the table


SINGLE_SESSION_NAMES = {
    "local_generate": "transformers generate (local)",
    "swarm_client": "swarm, Python client",
    "gateway_websocket": "gateway, WebSocket",
    "gateway_openai_sse": "gateway, OpenAI SSE",
}


def table(results: dict) -> str:
    device = results.get("device", "cpu")
    lines = [f"{results['model']} on {device}; prompt {results['prompt_tokens']['chat']} tokens; "
             f"{results['threads']['torch_threads_per_process']} torch thread(s) in every process "
             f"(gateway: {results['threads']['gateway']}); servers hold blocks {', '.join(results['spans'])}"]
    for dtype, variant in results["variants"].items():
        lines += ["", f"== {dtype} on {device} (block servers, the local model, and the gateway's and the Python "
                      "client's embeddings and LM head)"]
        lines += decode_round_lines(variant.get("decode_rounds") or {})
        lines += _single_session_lines(variant, results["options"])
        lines += _concurrency_lines(variant, results["options"])
        lines += usage_lines(variant)
        lines += _memory_lines(variant)
        lines += ["", "targets:"] + ["  " + target.describe() for target in targets(variant)]
    return "\n".join(lines)


def decode_round_lines(rounds: dict) -> list[str]:
    """ms per round of each model's span alone, per kind of round (decode, verify; eager, graphed) and count
    of sessions, the most sessions vs 1, and the path its timed rounds took."""
    if not rounds:
        return []
    counts = sorted({int(count) for run in rounds.values() for count in run["ms_per_round"]})
    width = max(len(name) for name in [*rounds, "model"])
    lines = ["", "one round of the span alone (no RPC), ms per round, medians of `rounds` rounds each (verify 1+k: "
                 "each session's step carries a draft of k tokens):",
             f"  {'model':{width}s} {'blocks':>6s} {'round':18s} {'rounds':>6s} "
             + " ".join(f"{f'{count} sess':>9s}" for count in counts) + "  most/1  path taken"]
    for name, run in rounds.items():
        for kind, figures in (run.get("kinds") or {"decode eager": run}).items():
            cells = " ".join(f"{figures['ms_per_round'].get(str(count), math.nan):9.2f}" for count in counts)
            lines.append(f"  {name:{width}s} {run['blocks']:>6s} {kind:18s} {figures['repeats']:6d} {cells}  "
                         f"{figures['ratio_most_to_one']:5.2f}x  {round_path(figures, run.get('captured', True))}")
    if any("kinds" in run for run in rounds.values()):
        captured = all(run.get("captured") for run in rounds.values())
        lines.append("  graphed: " + ("CUDA graphs captured (in the warm-ups) and replayed" if captured else
                                      "no CUDA graph on a CPU: the graphed path's padded rounds, run eagerly "
                                      "(use_graphs(capture=False)), shown as 'padded'"))
    return lines


def round_path(figures: dict, captured: bool) -> str:
    """The path a kind's timed rounds took: how many replayed a graph (on a CPU: ran its padded round), and the
    eager ones by reason; empty for results that did not count them."""
    graphed, eager = figures.get("graph_rounds"), figures.get("eager_rounds") or {}
    if graphed is None and not eager:
        return ""
    total = (graphed or 0) + sum(eager.values())
    parts = [f"{'graphs' if captured else 'padded'} {graphed:.0f}/{total:.0f}"] if graphed else []
    if eager:
        parts.append(f"eager {sum(eager.values()):.0f}/{total:.0f} ("
                     + ", ".join(f"{reason} {count:.0f}" for reason, count in sorted(eager.items())) + ")")
    return "; ".join(parts)


def speculation_line(tokens) -> list[str]:
    """How every single-session path decoded (bench.options.Options.speculative_tokens)."""
    if tokens is None:
        return []
    if not tokens:
        return ["  speculation: off on every path (gateway SPECULATIVE_TOKENS=0; the Python client and local "
                "generate one token per step); the concurrency runs share the gateway"]
    return [f"  speculation: drafts of up to {tokens} tokens by prompt lookup on every path (gateway "
            f"SPECULATIVE_TOKENS={tokens}; the Python client: the gateway's prompt lookup and pacing; local generate: "
            f"prompt_lookup_num_tokens={tokens}); the concurrency runs share the gateway"]


def _single_session_lines(variant: dict, options: dict) -> list[str]:
    single = variant["single_session"]
    lines = ["", f"single session, up to {options['tokens']} new tokens, medians of {options['rounds']} rounds:",
             *speculation_line(options.get("speculative_tokens")),
             f"  {'':32s} {'decode tok/s':>12s} {'TTFT ms':>8s} {'ITL p50 ms':>10s} {'ITL p95 ms':>10s}  tokens"]
    for name, label in SINGLE_SESSION_NAMES.items():
        run = single[name]
        lines.append(f"  {label:32s} {run['decode_tok_s']:12.2f} {run['ttft_s'] * 1000:8.0f} "
                     f"{run['itl_p50_s'] * 1000:10.1f} {run['itl_p95_s'] * 1000:10.1f}  {run['tokens']}"
                     + _errors(run))
    local, gateway = single["local_prefill_long"], single["gateway_websocket_long"]
    lines.append(f"  long prompt: local prefill {local['ttft_s'] * 1000:.0f} ms, "
                 f"gateway TTFT {gateway['ttft_s'] * 1000:.0f} ms" + _errors(gateway))
    return lines


def _concurrency_lines(variant: dict, options: dict) -> list[str]:
    lines = ["", f"simultaneous WebSocket sessions, {options['concurrency_tokens']} new tokens each "
                 "(a session's decode tok/s: the median session's; TTFT and ITL: across sessions and tokens):",
             f"  {'sessions':>8s} {'aggregate tok/s':>15s} {'decode tok/s':>16s} {'TTFT p50/p95 ms':>16s} "
             f"{'ITL p50/p95 ms':>15s}"]
    for sessions, run in variant["concurrency"].items():
        lines.append(f"  {sessions:>8s} {run['aggregate_tok_s']:15.2f} {run['per_session_decode_tok_s_p50']:16.2f} "
                     f"{run['ttft_p50_s'] * 1000:7.0f}/{run['ttft_p95_s'] * 1000:<8.0f} "
                     f"{run['itl_p50_s'] * 1000:6.1f}/{run['itl_p95_s'] * 1000:<8.1f}" + _errors(run))
    return lines


def usage_lines(variant: dict) -> list[str]:
    """Each process over each concurrency run (bench/usage.py): the servers' rows per round, graphed and eager
    rounds, every process's CPU per generated token; the GPU's utilisation on a GPU."""
    runs = {sessions: run["usage"] for sessions, run in variant["concurrency"].items() if run.get("usage")}
    if not runs:
        return []
    lines = ["", "each process over each concurrency run (servers' rounds from their /metrics, '-': not exported; "
                 "CPU: user + system ms per generated token, its p2pd apart):",
             f"  {'sessions':>8s} {'process':14s} {'rows/round':>10s} {'rounds':>7s} {'graphed':>7s} "
             f"{'CPU ms/tok':>10s} {'p2pd':>6s}  eager rounds by reason"]
    for sessions, usage in runs.items():
        for name, cpu in usage["cpu_ms_per_token"].items():
            rounds, reasons = _server_cells(usage["servers"].get(name))
            lines.append(f"  {sessions:>8s} {name:14s} {rounds} {_cell(cpu.get('own'), '10.2f')} "
                         f"{_cell(cpu.get('p2pd'), '6.2f')}  {reasons}".rstrip())
        if variant.get("device", "cpu") != "cpu":
            gpu = usage.get("gpu_utilisation")
            lines.append(f"  {sessions:>8s} GPU busy: " + (f"{gpu['mean_percent']:.0f}% mean, {gpu['max_percent']:.0f}% "
                                                           f"peak ({gpu['samples']} samples of nvidia-smi)"
                                                           if gpu else "not reported (no nvidia-smi)"))
    return lines


def _server_cells(server) -> tuple[str, str]:
    """A server's rows per round, rounds and graphed rounds, and its eager rounds by reason; blank for another
    process."""
    if server is None:
        return f"{'':10s} {'':7s} {'':7s}", ""
    cells = f"{_cell(server['rows_per_round'], '10.1f')} {_cell(server['rounds'], '7.0f')} " \
            f"{_cell(server['graph_rounds'], '7.0f')}"
    eager = server["eager_rounds"]
    if eager is None:
        return cells, "-"
    return cells, ", ".join(f"{reason} {count:.0f}" for reason, count in sorted(eager.items())) or "none"


def _cell(value, spec: str) -> str:
    """A figure, or '-' right-aligned in its width where it was not reported."""
    width = int(spec.split(".")[0])
    return f"{'-':>{width}s}" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else format(value, spec)


def _memory_lines(variant: dict) -> list[str]:
    on_gpu = variant.get("device", "cpu") != "cpu"
    lines = ["", "block servers' memory, MiB (RSS now / peak; peaks start again once the servers are up):",
             f"  {'blocks':>6s} {'weights':>8s} {'cache budget':>12s} {'at start':>10s} {'after single sessions':>22s} "
             f"{'after concurrency':>18s} {'its p2pd':>10s}" + (f" {'GPU at end':>10s}" if on_gpu else "")]
    for server in variant["memory"]:
        daemon, gpu = server["after_concurrency"]["p2pd"], server["after_concurrency"].get("gpu")
        lines.append(f"  {server['blocks']:>6s} {server['weights_bytes'] / MB:8.0f} {server['cache_budget_bytes'] / MB:12.0f} "
                     f"{_memory(server['at_start']['server']):>10s} {_memory(server['after_single_sessions']['server']):>22s} "
                     f"{_memory(server['after_concurrency']['server']):>18s} {_memory(daemon) if daemon else '-':>10s}"
                     + (f" {gpu / MB if gpu else math.nan:10.0f}" if on_gpu else "")
                     + ("" if server["peaks_reset_after_start"] else "  (peaks include start-up: could not reset)"))
    return lines


def _memory(sample: dict) -> str:
    return f"{sample['rss'] / MB:.0f} / {sample['peak'] / MB:.0f}"


def _errors(run: dict) -> str:
    errors = run["errors"]
    return f"  [{len(errors)} incomplete: {errors[0]}]" if errors else ""


# ------------------------------------------------------------------------------------------- files


def write_json(results: dict, path: Path) -> None:
    """Standard JSON: a figure that could not be measured (NaN) is null."""
    path.write_text(json.dumps(_nan_to_none(results), indent=1) + "\n")


def _nan_to_none(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _nan_to_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_to_none(item) for item in value]
    return value


# one color per figure, one line style per quantile; per dtype, a marker and the local baseline's line style
COLORS = {"aggregate": "tab:blue", "per_session": "tab:orange", "ttft": "tab:purple", "itl": "tab:green"}
QUANTILE_STYLES = {"p50": "-", "p95": ":"}
DTYPE_STYLES = {"float32": ("o", "--"), "bfloat16": ("^", "-."), "float16": ("s", ":")}


def plot(results: dict, path: Path) -> None:
    """Aggregate and per-session tok/s, and TTFT and ITL, against simultaneous sessions; local transformers
    generate as a dashed line (its decode tok/s on the left, its ITL on the right)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 16 and 400, not 2^4 and 4x10^2
    figure, (speed, latency) = plt.subplots(1, 2, figsize=(12, 4.8))
    for dtype, variant in results["variants"].items():
        runs, (marker, baseline) = variant["concurrency"], DTYPE_STYLES[dtype]
        sessions = [int(count) for count in runs]
        local = variant["single_session"]["local_generate"]

        def curve(axes, key: str, color: str, label: str, scale: float = 1.0, style: str = "-") -> None:
            axes.plot(sessions, [run[key] * scale for run in runs.values()], marker=marker, linestyle=style,
                      color=color, label=f"{label} ({dtype})")

        curve(speed, "aggregate_tok_s", COLORS["aggregate"], "aggregate")
        curve(speed, "per_session_decode_tok_s_p50", COLORS["per_session"], "per session, median")
        speed.axhline(local["decode_tok_s"], linestyle=baseline, color="gray", label=f"local generate ({dtype})")
        for figure_name in ("ttft", "itl"):
            for quantile, style in QUANTILE_STYLES.items():
                curve(latency, f"{figure_name}_{quantile}_s", COLORS[figure_name], f"{figure_name.upper()} {quantile}",
                      scale=1000, style=style)
        latency.axhline(local["itl_p50_s"] * 1000, linestyle=baseline, color="gray", label=f"local ITL p50 ({dtype})")

    counts = sorted({int(count) for variant in results["variants"].values() for count in variant["concurrency"]})
    for axes, title, unit in ((speed, "throughput", "tokens/s"), (latency, "latency", "ms")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(counts)
        axes.xaxis.set_major_formatter(plain)
        axes.xaxis.set_minor_formatter(NullFormatter())
        axes.set_xlabel("simultaneous sessions through the gateway (WebSocket)")
        axes.set_ylabel(unit)
        axes.set_title(title)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7)
    latency.set_yscale("log")
    latency.yaxis.set_major_formatter(plain)
    latency.yaxis.set_minor_formatter(plain)
    figure.suptitle(f"{results['model']}, two block servers on {results.get('device', 'cpu')}, "
                    f"{results['threads']['torch_threads_per_process']} "
                    f"torch thread(s) per process ({results['started']})", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
