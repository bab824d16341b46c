"""One run of the suite: per dtype, a swarm of two block servers and a gateway in front of it, then every
measurement, then memory. Returns plain data (dicts and lists) for bench/report.py.

Everything runs on the run's device (--device): the block servers, the local baseline and the gateway's (and
the Python client's) embeddings and LM head. The model is the default one, or a shape with random weights
(--shape, bench/shapes.py); its blocks are split in halves between the two servers.

Order within a dtype's run, and why:
  0. decode rounds of the tiny model's span and the benchmarked model's, alone in this process (no RPC), before
     anything else is loaded: the machine (and the GPU's memory) to themselves;
  1. block-server memory once they are up, with their start-up peak; then their peaks start again from there,
     since loading weights is not serving;
  2. single sessions, alternating local / Python client / WebSocket / OpenAI SSE and local prefill / gateway
     time to first token for the long prompt, round after round (after one untimed warm-up round): noise that
     comes and goes on a shared machine then hits every measurement alike, and medians drop the outliers;
  3. block-server memory, with the single sessions done;
  4. --concurrency's simultaneous WebSocket sessions (1, 4, 16, 64 on a CPU; 1, 8, 32, 64 on a GPU), smallest
     first, each on caches left empty by the one before, and what every process did meanwhile (bench/usage.py:
     each server's rows per round, graphed and eager rounds, every process's CPU per token, the GPU's use);
  5. block-server memory again: its peak now includes the largest run.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from config import GatewaySettings, SwarmSettings

from bench.clients import openai_reply, swarm_client_reply, websocket_reply
from bench.gateway import Gateway
from bench.load import concurrent_replies
from bench.local import LocalModel
from bench.memory import ServerBudget, reset_peaks, sample_server, server_budget
from bench.options import Options
from bench.shapes import SHAPES, model_folder
from bench.span_round import decode_rounds
from bench.stats import TokenStream, summarize_concurrent, summarize_runs
from bench.usage import MeteredSwarm, UsageWindow, Watched, watch
from bench.workload import MODEL, Prompt, chat_prompt, long_prompt, session_length


@dataclass(frozen=True)
class Prompts:
    chat: Prompt  # the chat prompt (~42 tokens) every reply continues
    long: Prompt  # LONG_PROMPT_TOKENS of plain text, for time to first token


@dataclass(frozen=True)
class Benchmarked:
    """The model of one dtype's run: how servers, the gateway and clients name it, and its folder."""

    name: str  # in the results: the default model's name, or the shape's
    source: str  # what servers, the gateway and the Python client are given: a known name or the folder
    folder: Path
    served_as: str  # the gateway's name for it (OpenAI's `model` field)
    spans: list[tuple[int, int]]  # the two servers' blocks


def run_suite(options: Options) -> dict:
    from swarm.weights import load_tokenizer

    torch.set_num_threads(options.threads)  # the local baseline and the Python client run in this process
    cache_dir = SwarmSettings.from_env().cache_dir
    results = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": options.shape or MODEL,
        "shape": SHAPES[options.shape] if options.shape else None,
        "device": options.device,
        "machine": machine(options.device),
        "options": asdict(options),
        "threads": thread_settings(options.threads),
        "variants": {},
    }
    began = time.perf_counter()
    for dtype in options.dtypes:
        log(f"== {dtype} on {options.device}")
        model = benchmarked(options, dtype, cache_dir)
        tokenizer = load_tokenizer(model.folder)
        prompts = Prompts(chat_prompt(tokenizer), long_prompt(tokenizer))
        results["prompt_tokens"] = {"chat": len(prompts.chat.ids), "long": len(prompts.long.ids)}
        results["spans"] = [f"{start}:{end}" for start, end in model.spans]
        results["variants"][dtype] = run_variant(options, model, cache_dir, dtype, prompts)
    results["duration_s"] = time.perf_counter() - began
    return results


def benchmarked(options: Options, dtype: str, cache_dir: Path) -> Benchmarked:
    from swarm.local import halves
    from swarm.weights import load_config

    name, folder = model_folder(options.shape, dtype, cache_dir, options.device)  # a shape is built on first use
    source = MODEL if options.shape is None else str(folder)
    served_as = GatewaySettings.from_env({"MODEL": source}).default_model.name  # as the gateway names it
    return Benchmarked(name, source, folder, served_as, halves(load_config(folder).num_hidden_layers))


def run_variant(options: Options, model: Benchmarked, cache_dir: Path, dtype: str, prompts: Prompts) -> dict:
    from swarm.client.remote_model import RemoteModel

    rounds = decode_rounds(options, dtype, cache_dir)  # alone on the machine: before any model is loaded
    cache_tokens = cache_tokens_needed(options, prompts)
    budgets = [server_budget(model.folder, start, end, cache_tokens, getattr(torch, dtype))
               for start, end in model.spans]
    local = LocalModel(model.folder, getattr(torch, dtype), options.device)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-logs-"))
    # the largest concurrency run, and a few single sessions that may still be closing when it starts
    max_sessions = max(options.concurrency) + 4
    server_args = ["--threads", str(options.threads), "--device", options.device, "--dtype", dtype,
                   "--cache-tokens", str(cache_tokens), *server_limits(max_sessions)]
    with ExitStack() as running:  # stopped in reverse order on any exit, Ctrl-C included
        log(f"starting block servers {', '.join(f'{start}:{end}' for start, end in model.spans)} and a gateway; "
            f"logs in {log_dir}")
        swarm = running.enter_context(MeteredSwarm(model.source, model.spans, server_args=server_args, log_dir=log_dir))
        # single sessions decode the same way on every path: the gateway's drafts are the Python client's and
        # local generate's (bench.options: --speculative-tokens)
        gateway = running.enter_context(Gateway(swarm.initial_peers, max_sessions, options.threads, log_dir,
                                                model.source, options.device, dtype,
                                                {"SPECULATIVE_TOKENS": str(options.speculative_tokens)}))
        remote = RemoteModel.from_pretrained(model.source, swarm.initial_peers, cache_dir, device=options.device,
                                             dtype=getattr(torch, dtype))
        running.callback(remote.close)
        memory, peaks_reset, single, concurrency = measure_swarm(
            options, model, prompts, local, remote, gateway,
            watch(swarm, gateway.process.process.pid, gpu=options.device != "cpu"))
        announced = [announced_gpu_bytes(server.ready_line) for server in swarm.servers]
    return {
        "device": options.device,
        "decode_rounds": rounds,
        "cache_tokens": cache_tokens,
        "single_session": {name: summarize_runs(runs) for name, runs in single.items()},
        "concurrency": concurrency,
        "memory": [{**memory_entry(budget, peaks_reset[index],
                                   {moment: samples[index] for moment, samples in memory.items()}),
                    "announced_gpu_bytes": announced[index]} for index, budget in enumerate(budgets)],
    }


def measure_swarm(options: Options, model: Benchmarked, prompts: Prompts, local: LocalModel, remote,
                  gateway: Gateway, processes: Watched) -> tuple[dict, list[bool], dict, dict]:
    """Memory samples, whether peaks could be reset, the single-session runs and the concurrency runs."""
    gpu = options.device != "cpu"
    server_pids = [pid for name, pid in processes.processes.items() if name in processes.servers]
    memory = {"at_start": [sample_server(pid, gpu) for pid in server_pids]}
    peaks_reset = [reset_peaks(pid) for pid in server_pids]
    single = alternate(single_session_measurements(options, model, prompts, local, remote, gateway), options.rounds)
    memory["after_single_sessions"] = [sample_server(pid, gpu) for pid in server_pids]
    concurrency = {str(sessions): run_concurrent(options, prompts, gateway, sessions, processes)
                   for sessions in options.concurrency}
    memory["after_concurrency"] = [sample_server(pid, gpu) for pid in server_pids]
    return memory, peaks_reset, single, concurrency


def single_session_measurements(options: Options, model: Benchmarked, prompts: Prompts, local: LocalModel, remote,
                                gateway: Gateway) -> dict[str, Callable[[], TokenStream]]:
    """Every single-session measurement, by the name the report uses, in the order they alternate."""
    chat, long, tokens, drafts = prompts.chat, prompts.long, options.tokens, options.speculative_tokens

    def deadline() -> float:
        return time.perf_counter() + options.timeout

    return {
        "local_generate": lambda: local.generate(chat.ids, tokens, drafts),
        "swarm_client": lambda: swarm_client_reply(remote, chat, tokens, drafts),
        "gateway_websocket": lambda: websocket_reply(gateway.ws_url, chat, tokens, deadline()),
        "gateway_openai_sse": lambda: openai_reply(gateway.openai_url, model.served_as, chat, tokens, deadline()),
        "local_prefill_long": lambda: local.prefill(long.ids),
        "gateway_websocket_long": lambda: websocket_reply(gateway.ws_url, long, 1, deadline()),
    }


def alternate(measurements: dict[str, Callable[[], TokenStream]], rounds: int) -> dict[str, list[TokenStream]]:
    """One untimed warm-up of each measurement, then `rounds` rounds that run each once, in turn."""
    for measure in measurements.values():
        measure()
    runs: dict[str, list[TokenStream]] = {name: [] for name in measurements}
    for round_number in range(1, rounds + 1):
        for name, measure in measurements.items():
            stream = measure()
            runs[name].append(stream)
            figure = f"{stream.decode_rate:6.1f} tok/s" if stream.tokens > 1 else f"TTFT {stream.ttft * 1000:6.0f} ms"
            log(f"round {round_number}/{rounds}  {name:24s} {figure}" + (f"  ({stream.error})" if stream.error else ""))
    return runs


def run_concurrent(options: Options, prompts: Prompts, gateway: Gateway, sessions: int, processes: Watched) -> dict:
    """The run's figures, and under `usage` what every process did meanwhile (bench/usage.py)."""
    gateway.wait_idle()  # the previous run's sessions closed: this one starts on empty caches
    log(f"{sessions} simultaneous sessions, {options.concurrency_tokens} tokens each")
    with UsageWindow(processes) as window:
        streams = concurrent_replies(gateway.ws_url, prompts.chat, options.concurrency_tokens, sessions,
                                     options.timeout)
    summary = summarize_concurrent(streams)
    summary["usage"] = window.result(summary["tokens"])
    incomplete = f", {len(summary['errors'])} incomplete" if summary["errors"] else ""
    servers = "; ".join(f"{name}: {server['rows_per_round']:.1f} rows/round"
                        for name, server in summary["usage"]["servers"].items())
    log(f"   {summary['aggregate_tok_s']:.1f} tok/s aggregate{incomplete}; {servers}")
    return summary


def server_limits(max_sessions: int) -> list[str]:
    """A block server's flags lifting its per-peer session cap over the run's sessions: the gateway is one peer
    for all of them (bench.gateway.bench_limits lifts the gateway's caps)."""
    from swarm.server.settings import ServerLimits

    return ["--max-sessions-per-peer", str(max(max_sessions, ServerLimits.max_sessions_per_peer))]


def cache_tokens_needed(options: Options, prompts: Prompts) -> int:
    """Each server's cache budget: the servers' default, or more if the largest concurrency run's sessions
    all at once, plus one more session (one still closing when the next opens), need more."""
    single = max(session_length(prompts.chat, options.tokens), session_length(prompts.long, 1))
    needed = max(options.concurrency) * session_length(prompts.chat, options.concurrency_tokens) + single
    return max(needed, SwarmSettings.cache_tokens)


def announced_gpu_bytes(ready_line: Optional[str]) -> Optional[int]:
    """What a server on a GPU says it holds there (its ready line: weights, cache, graphs and CUDA context), in
    bytes; None on a CPU."""
    found = re.search(r", GPU memory ([0-9.]+) GiB", ready_line or "")
    return int(float(found.group(1)) * 2**30) if found else None


def memory_entry(budget: ServerBudget, peaks_reset: bool, samples: dict) -> dict:
    """One server's budget and its memory samples (at_start, after_single_sessions, after_concurrency)."""
    return {
        "blocks": f"{budget.start}:{budget.end}",
        "cache_tokens": budget.cache_tokens,
        "weights_bytes": budget.weights_bytes,
        "cache_budget_bytes": budget.cache_bytes,
        # False: the kernel refused to reset peaks, and later peaks include the start-up one
        "peaks_reset_after_start": peaks_reset,
        **samples,
    }


def thread_settings(threads: int) -> dict:
    return {
        "torch_threads_per_process": threads,
        "local_baseline_and_python_client": f"torch.set_num_threads({threads}) in the benchmark process",
        "block_servers": f"--threads {threads}",
        "gateway": f"TORCH_THREADS={threads}",
    }


def machine(device: str) -> dict:
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
    }


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
