"""`python -m bench`: the whole benchmark suite in one run; see bench/__init__.py for what it measures.

    python -m bench [--quick] [--device cpu|cuda] [--dtype float32,bfloat16,float16] [--shape NAME]
                    [--tokens 128] [--rounds 3] [--concurrency 1,4,16,64] [--concurrency-tokens 64]
                    [--round-sessions 1,8,32,64] [--round-drafts 4,8] [--round-repeats 10] [--threads 1]
                    [--speculative-tokens 0] [--bfloat16] [--timeout 300] [--out bench/results]

Prints a table and the targets (PASS or FAIL), writes OUT/<time>.json and OUT/<time>.png, and exits 0
whatever the verdicts: it is a benchmark, not a test. `python -m bench.span_round` runs the decode rounds of
a span alone (no swarm), with the same --device, --dtype, --shape, --threads and --round-* flags.
"""

from __future__ import annotations

import sys
import time

from bench.options import parse_options
from bench.report import plot, table, targets, write_json
from bench.suite import run_suite


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
