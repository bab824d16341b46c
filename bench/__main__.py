"""`python -m bench`: the whole benchmark suite in one run; see bench/__init__.py for what it measures.

    python -m bench [--quick] [--tokens 128] [--rounds 3] [--concurrency 1,4,16,64] [--concurrency-tokens 64]
                    [--threads 1] [--bfloat16] [--timeout 300] [--out bench/results]

Prints a table and the targets (PASS or FAIL), writes OUT/<time>.json and OUT/<time>.png, and exits 0
whatever the verdicts: it is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.report import plot, table, targets, write_json
from bench.suite import Options, run_suite

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# --quick: a smoke run of every measurement in a few minutes; fewer tokens and rounds, no 16 or 64 sessions
FULL = {"tokens": 128, "rounds": 3, "concurrency": (1, 4, 16, 64), "concurrency_tokens": 64}
QUICK = {"tokens": 32, "rounds": 1, "concurrency": (1, 4), "concurrency_tokens": 16}


def concurrency_list(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, e.g. 1,4,16,64; got {text!r}")
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"every count of sessions must be at least 1; got {text!r}")
    return tuple(sorted(set(counts)))


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_options(argv=None) -> tuple[Options, Path]:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    parser.add_argument("--tokens", type=positive_int, help=f"new tokens per single-session reply (default {FULL['tokens']})")
    parser.add_argument("--rounds", type=positive_int, help=f"alternating timed rounds (default {FULL['rounds']})")
    parser.add_argument("--concurrency", type=concurrency_list, help="simultaneous sessions to run, e.g. 1,4,16,64")
    parser.add_argument("--concurrency-tokens", type=positive_int,
                        help=f"new tokens per session in the concurrency runs (default {FULL['concurrency_tokens']})")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads in every process (default 1)")
    parser.add_argument("--bfloat16", action="store_true", help="also run servers and the local model in bfloat16")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds any one reply or concurrency run may take before it is cut (default 300)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for the JSON and the plot")
    args = parser.parse_args(argv)

    defaults = QUICK if args.quick else FULL
    chosen = {name: getattr(args, name) if getattr(args, name) is not None else default
              for name, default in defaults.items()}
    options = Options(**chosen, threads=args.threads, timeout=args.timeout,
                      dtypes=("float32", "bfloat16") if args.bfloat16 else ("float32",))
    return options, args.out


def main(argv=None) -> None:
    options, out = parse_options(argv)
    results = run_suite(options)
    for variant in results["variants"].values():
        variant["targets"] = [target.as_dict() for target in targets(variant)]

    out.mkdir(parents=True, exist_ok=True)
    stem = out / time.strftime("%Y%m%d-%H%M%S")
    json_path, plot_path = stem.with_suffix(".json"), stem.with_suffix(".png")
    write_json(results, json_path)
    plot(results, plot_path)
    print(table(results))
    print(f"\nran for {results['duration_s']:.0f} s; wrote {json_path} and {plot_path}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # every child process has been stopped on the way out
        sys.exit(130)
