"""`python -m bench.engine`: what the gateway's engine loop costs and gives, at 1, 16 and 64 sessions.

    python -m bench.engine [--shape tiny] [--device cpu] [--sessions 1,16,64] [--tokens 64] [--out bench/results]
                           [--env NAME=VALUE ...]

Two block servers and a real gunicorn gateway, as in production; for each count of sessions, that many WebSocket
sessions generate `--tokens` tokens at once (the first prompt of bench/workload.py, greedy). It prints, per count:
aggregate tok/s, each session's time per token, the CPU the gateway's worker (and its whole process tree: the
gunicorn master, the worker and its libp2p daemon), the block servers (with their daemons) and the WebSocket
clients (this process, on the same cores) spent per generated token, and the engine loop's rows per tick
and chain steps per tick (from its /metrics counters), and the time to first token. A second table says where a
step's time goes, stage by stage (swarm/client/stage_clock.py, read from the gateway's /metrics): the engine loop's
wake-up and tick, the hand-off to the client's event loop, each hop's queue, round trip and transport, and what
each server says it spent of it (decoding, waiting for its compute thread, computing, replying), in mean ms per
step; and each server's busy fraction (its compute over the wall time). `--shape tiny` is the tests' tiny model:
its compute is close to nothing, so what is left is the overhead a GPU box would see. Without --shape: the default
model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import requests

from bench.gateway import Gateway
from bench.load import concurrent_replies
from bench.stats import summarize_concurrent
from bench.workload import chat_prompt, session_length

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
COUNTERS = ("ticks", "rows", "steps")  # gateway_engine_*_total


def main(argv=None) -> None:
    options = parse(argv)
    results = run(options)
    print(table(results))
    print(stage_table(results))
    options.out.mkdir(parents=True, exist_ok=True)
    path = options.out / time.strftime("engine-%Y%m%d-%H%M%S.json")
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="tiny", help="a shape of bench/shapes.py; 'default' for the default model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on a GPU")
    parser.add_argument("--sessions", default="1,16,64", type=lambda text: [int(n) for n in text.split(",")])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--env", action="append", default=[], help="a gateway setting, NAME=VALUE (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    options = parser.parse_args(argv)
    options.dtype = options.dtype or ("float32" if options.device == "cpu" else "bfloat16")
    return options


def run(options: argparse.Namespace) -> dict:
    import torch

    from bench.shapes import model_folder
    from config import SwarmSettings
    from swarm.local import LocalSwarm, halves
    from swarm.weights import load_config, load_tokenizer

    cache_dir = SwarmSettings.from_env().cache_dir
    shape = None if options.shape == "default" else options.shape
    name, folder = model_folder(shape, options.dtype, cache_dir, options.device)
    source = str(folder) if shape is not None else name
    prompt = chat_prompt(load_tokenizer(folder))
    most = max(options.sessions)
    cache_tokens = (most + 2) * session_length(prompt, options.tokens) * 2
    server_args = ["--threads", str(options.threads), "--device", options.device, "--dtype", options.dtype,
                   "--cache-tokens", str(cache_tokens)]
    log_dir = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    env = dict(item.split("=", 1) for item in options.env)
    results = {"model": name, "device": options.device, "dtype": options.dtype, "tokens": options.tokens,
               "env": env, "torch": torch.__version__, "cpus": os.cpu_count(), "runs": {}}
    with ExitStack() as running:
        spans = halves(load_config(folder).num_hidden_layers)
        swarm = running.enter_context(LocalSwarm(source, spans, server_args=server_args, log_dir=log_dir))
        gateway = running.enter_context(Gateway(swarm.initial_peers, most + 4, options.threads, log_dir, source,
                                                options.device, options.dtype, env=env))
        concurrent_replies(gateway.ws_url, prompt, options.tokens, 1, options.timeout)  # warm-up: loads the model
        for sessions in options.sessions:
            servers = [server.process.pid for server in swarm.servers]
            results["runs"][str(sessions)] = measure(gateway, servers, prompt, options, sessions)
            print(f"{sessions:3d} sessions: {results['runs'][str(sessions)]}", flush=True)
    return results


def measure(gateway: Gateway, servers: list[int], prompt, options: argparse.Namespace, sessions: int) -> dict:
    gateway.wait_idle()
    master = gateway.process.process.pid
    worker = _children(master)[0]
    cpu_before, worker_before, counters_before = _tree_cpu(master), _cpu(worker), _counters(gateway)
    servers_before, stages_before = [_tree_cpu(pid) for pid in servers], _stages(gateway)
    clients_before = _cpu(os.getpid())
    summary = summarize_concurrent(concurrent_replies(gateway.ws_url, prompt, options.tokens, sessions,
                                                      options.timeout))
    cpu_after, worker_after, counters_after = _tree_cpu(master), _cpu(worker), _counters(gateway)
    servers_after, stages_after = [_tree_cpu(pid) for pid in servers], _stages(gateway)
    clients_after = _cpu(os.getpid())
    tokens = max(summary["tokens"], 1)
    server_cpu = [(after - before) * 1000 / tokens for before, after in zip(servers_before, servers_after)]
    ticks = max(counters_after["ticks"] - counters_before["ticks"], 1)
    return {
        "aggregate_tok_s": round(summary["aggregate_tok_s"], 1),
        "ms_per_token_per_session": round(1000 / summary["per_session_decode_tok_s_p50"], 2),
        "worker_cpu_ms_per_token": round((worker_after - worker_before) * 1000 / tokens, 3),
        "gateway_tree_cpu_ms_per_token": round((cpu_after - cpu_before) * 1000 / tokens, 3),
        "servers_cpu_ms_per_token": round(sum(server_cpu), 3),
        "each_server_cpu_ms_per_token": [round(cpu, 3) for cpu in server_cpu],
        # the WebSocket clients, in this process on the same cores: what they take is not the product's to spend
        "clients_cpu_ms_per_token": round((clients_after - clients_before) * 1000 / tokens, 3),
        "ttft_ms_p50": round(summary["ttft_p50_s"] * 1000, 1),
        "busy_fraction": _busy(stages_before, stages_after, summary["wall_s"]),
        "stages_ms": _stage_means(stages_before, stages_after),
        "rows_per_tick": round((counters_after["rows"] - counters_before["rows"]) / ticks, 2),
        "steps_per_tick": round((counters_after["steps"] - counters_before["steps"]) / ticks, 2),
        "tokens": summary["tokens"],
        "errors": summary["errors"][:3],
    }


def table(results: dict) -> str:
    lines = [f"{results['model']} on {results['device']} ({results['dtype']}), {results['tokens']} tokens per session"
             f"{', ' + str(results['env']) if results['env'] else ''}",
             f"{'sessions':>8} {'tok/s':>9} {'ms/tok/session':>15} {'worker CPU ms/tok':>18} "
             f"{'tree CPU ms/tok':>16} {'servers CPU ms/tok':>19} {'clients CPU ms/tok':>19} {'rows/tick':>10} "
             f"{'steps/tick':>11}"]
    for sessions, run in results["runs"].items():
        lines.append(f"{sessions:>8} {run['aggregate_tok_s']:>9} {run['ms_per_token_per_session']:>15} "
                     f"{run['worker_cpu_ms_per_token']:>18} {run['gateway_tree_cpu_ms_per_token']:>16} "
                     f"{run['servers_cpu_ms_per_token']:>19} {run.get('clients_cpu_ms_per_token', ''):>19} "
                     f"{run['rows_per_tick']:>10} {run['steps_per_tick']:>11}")
    return "\n".join(lines)


def stage_table(results: dict) -> str:
    """Where a step's time goes (swarm/client/stage_clock.py): each stage's mean ms per step, for each run."""
    runs = results["runs"]
    stages = sorted({stage for run in runs.values() for stage in run["stages_ms"]}, key=_stage_order)
    lines = [f"{'stage (ms per step)':<34}" + "".join(f"{sessions + ' sess':>12}" for sessions in runs)]
    for stage in stages:
        lines.append(f"{stage:<34}" + "".join(f"{run['stages_ms'].get(stage, ''):>12}" for run in runs.values()))
    lines.append(f"{'ttft ms (p50)':<34}" + "".join(f"{run['ttft_ms_p50']:>12}" for run in runs.values()))
    lines.append(f"{'servers busy (compute / wall)':<34}" + "".join(
        f"{' '.join(f'{busy:.2f}' for busy in run['busy_fraction'].values()):>12}" for run in runs.values()))
    return "\n".join(lines)


STAGE_ORDER = ("engine_wake", "engine_sample", "engine_send", "client_handoff", "client_step", "hop_queue",
               "hop_round_trip", "hop_transport", "server_total", "server_decode", "server_queue", "server_compute",
               "server_reply", "reader_wake")


def _stage_order(name: str) -> tuple:
    stage, _, blocks = name.partition("@")
    return (STAGE_ORDER.index(stage) if stage in STAGE_ORDER else len(STAGE_ORDER), blocks)


def _stages(gateway: Gateway) -> dict[str, list[float]]:
    """{"stage@blocks": [seconds, events]} from the gateway's /metrics."""
    text = requests.get(gateway.url + "/metrics", timeout=10).text
    stages: dict[str, list[float]] = {}
    for kind, index in (("seconds", 0), ("events", 1)):
        for labels, value in re.findall(rf"^swarm_step_stage_{kind}_total{{([^}}]*)}} (\S+)$", text, re.MULTILINE):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            stage, blocks = labels.get("stage", ""), labels.get("blocks", "")
            stages.setdefault(f"{stage}@{blocks}" if blocks else stage, [0.0, 0.0])[index] = float(value)
    return stages


def _stage_means(before: dict, after: dict) -> dict[str, float]:
    means = {}
    for stage, (seconds, events) in after.items():
        seconds_before, events_before = before.get(stage, (0.0, 0.0))
        if events > events_before:
            means[stage] = round((seconds - seconds_before) * 1000 / (events - events_before), 3)
    return means


def _busy(before: dict, after: dict, wall: float) -> dict[str, float]:
    """Each server's time computing over the wall time (its "server_busy": compute per message)."""
    busy = {}
    for stage, (seconds, _) in after.items():
        if stage.startswith("server_busy@"):
            busy[stage.partition("@")[2]] = round((seconds - before.get(stage, (0.0, 0.0))[0]) / wall, 3)
    return busy


def _counters(gateway: Gateway) -> dict[str, float]:
    text = requests.get(gateway.url + "/metrics", timeout=10).text
    return {name: sum(float(value) for value in re.findall(rf"^gateway_engine_{name}_total{{[^}}]*}} (\S+)$", text,
                                                            re.MULTILINE)) for name in COUNTERS}


def _cpu(pid: int) -> float:
    """User + system CPU seconds of a live process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _children(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(child) for child in (task / "children").read_text().split()]
    return children


def _tree_cpu(pid: int) -> float:
    try:
        return _cpu(pid) + sum(_tree_cpu(child) for child in _children(pid))
    except FileNotFoundError:  # a process that ended meanwhile
        return 0.0


if __name__ == "__main__":
    main()
