"""`python -m bench.churn`: a swarm under churn on this machine (loopback only), bounded in time.

    python -m bench.churn [--quick] [--servers 16] [--blocks 24] [--model NAME_OR_PATH] [--latency 50]
                          [--latency-spread 0.5] [--jitter 5] [--churn-every 5] [--duration 300] [--sessions 32]
                          [--tokens 24] [--threads 1] [--seed 0] [--json PATH]

A bootstrap peer, --servers block servers (each its own span, round trip and identity) and two real gunicorn
gateways; every --churn-every seconds a server leaves (SIGTERM, or kill -9) or joins (a new one, or one that left
coming back with its identity); meanwhile --sessions workers generate greedy replies through both gateways'
OpenAI API (streamed) until --duration is over. Prints and writes (--json) the summary: sessions completed and
failed, replies equal to the local model's, failovers, joins, and the chains chosen against the best possible.
Exits 0 whatever the figures: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

QUICK = dict(servers=8, blocks=16, duration=60.0, sessions=8, tokens=16)


def parse_options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.churn", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a short run: 8 servers, 16 blocks, 60 s, 8 sessions of 16 tokens (flags given win)")
    parser.add_argument("--servers", type=int, help="block servers at the start, and the population churn keeps (16)")
    parser.add_argument("--blocks", type=int, help="blocks of the harness's tiny random model (24)")
    parser.add_argument("--model", help="serve this model (a known name or a folder) instead of the tiny one")
    parser.add_argument("--latency", type=float, default=50.0, help="mean round trip per hop, ms (50)")
    parser.add_argument("--latency-spread", type=float, default=0.5,
                        help="each server's round trip is uniform in latency x (1 +- spread) (0.5)")
    parser.add_argument("--jitter", type=float, default=5.0, help="--simulated-latency-jitter of every server, ms (5)")
    parser.add_argument("--churn-every", type=float, default=5.0, help="seconds between churn events (5)")
    parser.add_argument("--duration", type=float, help="seconds of sessions and churn (300)")
    parser.add_argument("--sessions", type=int, help="concurrent session workers (32)")
    parser.add_argument("--tokens", type=int, help="new tokens per reply, greedy (24)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each process (1)")
    parser.add_argument("--seed", type=int, default=0, help="spans, round trips and churn choices (0)")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    options = parser.parse_args(argv)
    defaults = QUICK if options.quick else dict(servers=16, blocks=24, duration=300.0, sessions=32, tokens=24)
    for name, value in defaults.items():
        if getattr(options, name) is None:
            setattr(options, name, value)
    if options.servers < 4 or options.sessions < 1 or options.duration <= 0 or options.churn_every <= 0:
        parser.error("--servers must be at least 4, --sessions at least 1, --duration and --churn-every positive")
    if not 0 <= options.latency_spread < 1:
        parser.error("--latency-spread must be in [0, 1)")
    return options


def main(argv=None) -> dict:
    options = parse_options(argv)
    from bench.churn.run import run_churn
    from bench.churn.summary import print_summary

    log_dir = Path(tempfile.mkdtemp(prefix="bench-churn-"))
    print(f"logs in {log_dir}", flush=True)
    summary = run_churn(options, log_dir, random.Random(options.seed))
    print_summary(summary)
    if options.json:
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(summary, indent=1))
        print(f"wrote {options.json}")
    return summary


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # every child process has been stopped on the way out
        sys.exit(130)
