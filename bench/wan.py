"""`python -m bench.wan`: decode speed across a simulated WAN, with and without speculative decoding.

    python -m bench.wan [--quick] [--latencies 0,25,50,100] [--tokens 64] [--rounds 1] [--sessions 32]
                        [--concurrency-latencies 0,50] [--concurrency-tokens 32] [--threads 1] [--json PATH]

The default model on two block servers (its blocks in halves), each started with `--simulated-latency MS` for
every MS of --latencies (a fresh swarm per latency), and two real gunicorn gateways in front of them: one with
SPECULATIVE_TOKENS=0 (plain decoding) and one with the default (speculation on). Measures, greedily through the
OpenAI API (streamed, the official `openai` client):
  1. one session's decode tokens/s (the tokens after the first over their time) for copy-heavy chats (JSON, code,
     a quoted passage: answers that copy the prompt) and free chat, on each gateway, alternating; every reply of
     the speculating gateway must equal the plain one's;
  2. at each of --concurrency-latencies, --sessions sessions at once on each gateway: aggregate tokens/s (every
     token over the wall time).
Prints a Markdown table and the issue's targets (PASS or FAIL), writes JSON (--json, default
bench/results/wan-<time>.json); exits 0 whatever they are: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from bench.gateway import Gateway
from bench.wan_prompts import WORKLOADS
from bench.workload import MODEL

# each gateway's settings: speculation off, or its default; no session store (the two would share one file)
VARIANTS = {"plain": {"SPECULATIVE_TOKENS": "0", "SESSION_STORE": "off"}, "speculative": {"SESSION_STORE": "off"}}
REPLY_TIMEOUT = 600.0


@dataclass
class TimedReply:
    text: str
    tokens: int
    sent: float
    first: Optional[float]  # when the first piece of text came
    last: Optional[float]  # when the last one came
    error: str = ""

    @property
    def decode_seconds(self) -> float:
        return (self.last - self.first) if self.first is not None and self.tokens > 1 else 0.0


def timed_reply(base_url: str, content: str, tokens: int) -> TimedReply:
    """One greedy, streamed chat reply of at most `tokens` tokens, timed as its pieces arrive."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", timeout=REPLY_TIMEOUT, max_retries=0)
    reply = TimedReply("", 0, time.perf_counter(), None, None)
    pieces = []
    try:
        for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                    max_tokens=tokens, temperature=0, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.usage is not None:
                reply.tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                reply.last = time.perf_counter()
                reply.first = reply.first or reply.last
                pieces.append(chunk.choices[0].delta.content)
    except Exception as error:  # the figure records it; the other replies still count
        reply.error = f"{type(error).__name__}: {error}"[:300]
    finally:
        client.close()
    reply.text = "".join(pieces)
    return reply


def single_sessions(gateways: dict[str, Gateway], tokens: int, rounds: int) -> dict:
    """Per workload, per variant: every reply (text, tokens, seconds), alternating the variants prompt by prompt."""
    replies = {workload: {variant: [] for variant in gateways} for workload in WORKLOADS}
    for _ in range(rounds):
        for workload, prompts in WORKLOADS.items():
            for content in prompts.values():
                for variant, gateway in gateways.items():
                    replies[workload][variant].append(timed_reply(gateway.openai_url, content, tokens))
    return replies


def decode_rate(replies: list[TimedReply]) -> float:
    """Decode tokens/s over replies: their tokens after the first over the time from first to last piece."""
    seconds = sum(reply.decode_seconds for reply in replies)
    return sum(reply.tokens - 1 for reply in replies if reply.decode_seconds) / seconds if seconds else 0.0


def concurrent_sessions(gateway: Gateway, sessions: int, tokens: int) -> dict:
    """`sessions` replies at once (all prompts in turn): aggregate tokens/s over the wall time."""
    contents = [content for prompts in WORKLOADS.values() for content in prompts.values()]
    start = threading.Barrier(sessions)

    def one(index: int) -> TimedReply:
        start.wait()
        return timed_reply(gateway.openai_url, contents[index % len(contents)], tokens)

    with ThreadPoolExecutor(max_workers=sessions) as pool:
        replies = list(pool.map(one, range(sessions)))
    wall = max((reply.last or reply.sent) for reply in replies) - min(reply.sent for reply in replies)
    total = sum(reply.tokens for reply in replies)
    return {"sessions": sessions, "tokens": total, "wall_s": round(wall, 2),
            "aggregate_tok_s": round(total / wall, 2) if wall > 0 else 0.0,
            "errors": [reply.error for reply in replies if reply.error]}


def measure_latency(latency: int, options: argparse.Namespace, log_dir: Path) -> dict:
    """A fresh swarm whose servers add `latency` ms per hop, both gateways, and every measurement on them."""
    from config import SwarmSettings
    from swarm.local import LocalSwarm, halves
    from swarm.weights import load_config, resolve_model

    spans = halves(load_config(resolve_model(MODEL, SwarmSettings.from_env().cache_dir)).num_hidden_layers)
    server_args = ["--threads", str(options.threads)] + (["--simulated-latency", str(latency)] if latency else [])
    here = log_dir / f"{latency}ms"
    for variant in VARIANTS:
        (here / variant).mkdir(parents=True)
    print(f"{latency} ms per hop: starting block servers {spans} and two gateways", flush=True)
    with LocalSwarm(MODEL, spans, server_args=server_args, log_dir=here) as swarm:
        gateways = {variant: Gateway(swarm.initial_peers, options.sessions + 8, options.threads, here / variant,
                                     env=env) for variant, env in VARIANTS.items()}
        try:
            for gateway in gateways.values():
                gateway.start()
                timed_reply(gateway.openai_url, "Hello!", 4)  # a warm-up: the first reply loads what it needs
            replies = single_sessions(gateways, options.tokens, options.rounds)
            concurrency = {variant: concurrent_sessions(gateway, options.sessions, options.concurrency_tokens)
                           for variant, gateway in gateways.items()} if latency in options.concurrency_latencies else {}
        finally:
            for gateway in gateways.values():
                gateway.stop()
    return {"latency_ms": latency, "concurrency": concurrency,
            "single": {workload: {variant: {"decode_tok_s": round(decode_rate(runs), 2),
                                            "replies": [asdict(reply) for reply in runs]}
                                  for variant, runs in by_variant.items()}
                       for workload, by_variant in replies.items()}}


def identical(result: dict) -> list[str]:
    """Where the speculating gateway's reply differs from the plain one's (latency, workload, reply number)."""
    differences = []
    for workload, variants in result["single"].items():
        for number, (plain, speculative) in enumerate(zip(variants["plain"]["replies"],
                                                           variants["speculative"]["replies"])):
            if plain["text"] != speculative["text"] or plain["error"] or speculative["error"]:
                differences.append(f"{result['latency_ms']} ms, {workload}, reply {number}")
    return differences


def table(results: list[dict]) -> str:
    lines = ["| ms per hop | copy-heavy, plain | copy-heavy, speculative | speed-up | chat, plain | chat, speculative "
             "| speed-up |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for result in results:
        cells = [str(result["latency_ms"])]
        for workload in WORKLOADS:
            plain = result["single"][workload]["plain"]["decode_tok_s"]
            speculative = result["single"][workload]["speculative"]["decode_tok_s"]
            cells += [f"{plain:.2f}", f"{speculative:.2f}", f"{speculative / plain:.2f}x" if plain else "n/a"]
        lines.append("| " + " | ".join(cells) + " |")
    runs = [(result["latency_ms"], variant, run) for result in results for variant, run in result["concurrency"].items()]
    if runs:
        lines += ["", "| ms per hop | gateway | sessions | aggregate tok/s |", "| --- | --- | --- | --- |"]
        lines += [f"| {latency} | {variant} | {run['sessions']} | {run['aggregate_tok_s']:.2f} |"
                  for latency, variant, run in runs]
    return "\n".join(lines)


def targets(results: list[dict]) -> list[tuple[str, Optional[bool], str]]:
    """The issue's targets at 50 ms per hop: (label, passed or None when not measured, figure)."""
    by_latency = {result["latency_ms"]: result for result in results}
    verdicts = []
    for workload, floor in (("copy-heavy", 2.0), ("chat", 1.3)):
        figure = by_latency.get(50, {}).get("single", {}).get(workload)
        ratio = figure["speculative"]["decode_tok_s"] / figure["plain"]["decode_tok_s"] \
            if figure and figure["plain"]["decode_tok_s"] else None
        verdicts.append((f"speculation >= {floor}x on {workload} at 50 ms per hop", None if ratio is None
                         else ratio >= floor, "not measured" if ratio is None else f"{ratio:.2f}x"))
    differences = [difference for result in results for difference in identical(result)]
    verdicts.append(("outputs identical with and without speculation", not differences,
                     "identical" if not differences else "differ: " + "; ".join(differences[:5])))
    for variant in VARIANTS:
        slow, fast = (by_latency.get(latency, {}).get("concurrency", {}).get(variant) for latency in (50, 0))
        ratio = slow["aggregate_tok_s"] / fast["aggregate_tok_s"] if slow and fast and fast["aggregate_tok_s"] else None
        verdicts.append((f"{variant}: sessions' aggregate tok/s at 50 ms >= 0.8x at 0 ms",
                         None if ratio is None else ratio >= 0.8, "not measured" if ratio is None else f"{ratio:.2f}x"))
    return verdicts


def parse_options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.wan", description=__doc__.splitlines()[0])
    numbers = lambda text: [int(item) for item in text.split(",") if item]  # noqa: E731
    parser.add_argument("--quick", action="store_true",
                        help="0 and 50 ms, 24 tokens, 8 sessions of 16 tokens (flags given win)")
    parser.add_argument("--latencies", type=numbers, help="ms per hop, one swarm each (0,25,50,100)")
    parser.add_argument("--tokens", type=int, help="most new tokens per single-session reply (64)")
    parser.add_argument("--rounds", type=int, default=1, help="times each prompt is asked of each gateway (1)")
    parser.add_argument("--sessions", type=int, help="concurrent sessions of the aggregate run (32)")
    parser.add_argument("--concurrency-latencies", type=numbers, default=[0, 50],
                        help="ms per hop at which the concurrent sessions run (0,50)")
    parser.add_argument("--concurrency-tokens", type=int, help="new tokens per concurrent session (32)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each process (1)")
    parser.add_argument("--json", type=Path, help="where to write every figure (default bench/results/wan-TIME.json)")
    options = parser.parse_args(argv)
    defaults = dict(latencies=[0, 50], tokens=24, sessions=8, concurrency_tokens=16) if options.quick else \
        dict(latencies=[0, 25, 50, 100], tokens=64, sessions=32, concurrency_tokens=32)
    for name, value in defaults.items():
        if getattr(options, name) is None:
            setattr(options, name, value)
    if options.json is None:
        options.json = Path(__file__).parent / "results" / time.strftime("wan-%Y%m%d-%H%M%S.json")
    return options


def main(argv=None) -> list[dict]:
    options = parse_options(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-wan-"))
    print(f"logs in {log_dir}", flush=True)
    results = [measure_latency(latency, options, log_dir) for latency in options.latencies]
    print("\n" + table(results) + "\n")
    verdicts = targets(results)
    for label, passed, figure in verdicts:
        print(f"{'n/a ' if passed is None else 'PASS' if passed else 'FAIL'}  {label}: {figure}")
    options.json.parent.mkdir(parents=True, exist_ok=True)
    options.json.write_text(json.dumps({"options": {**vars(options), "json": str(options.json)}, "results": results,
                                        "targets": [dict(zip(("target", "passed", "figure"), verdict))
                                                    for verdict in verdicts]}, indent=1))
    print(f"wrote {options.json}")
    return results


if __name__ == "__main__":
    main()
