"""One decode round of a span alone: what each session adds to a block server's round, with no RPC, no
batching thread and no client in the way.

    python -m bench.span_round [--shape NAME] [--device cpu|cuda] [--dtype float32] [--threads 1]
                               [--round-sessions 1,8,32,64] [--round-repeats 10]

The model's blocks are loaded with swarm.server.span.load_span; 64 sessions (span.new_cache) are prefilled
to 64 different lengths (40, 13, 50, ...: any first N of them average about the same length); then a
round feeds one new token to each of the first N sessions in one span.forward_packed over N decode
segments (swarm.server.attention.Segment), at each session's next position. Every round writes the same
positions again, so every repeat does the same work. Rounds alternate between the session counts, repeat
after repeat, so that noise on a shared machine hits each count alike; cheap rounds repeat for a few seconds
at least (MIN_TIMED_SECONDS); the figure is the median.

A round's cost that grows with N only through its matrix products (N rows instead of 1, the weights read once)
is what batching promises; per-session work (Python per segment, one attention call per session) shows as a
ratio of 64 sessions to 1 well above what the arithmetic needs. The target: <= 3x on the tiny model on a CPU.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from bench.options import ROUND_SESSIONS, parse_round_options

SHORTEST_PREFILL = 8  # session lengths are SHORTEST_PREFILL .. SHORTEST_PREFILL + 63
# rounds of a small model take milliseconds, and a shared machine's noise comes in bursts as long: such rounds
# repeat until this many seconds were timed (at most MAX_REPEATS times), so that their median holds still
MIN_TIMED_SECONDS = 3.0
MAX_REPEATS = 300


def prefill_lengths(sessions: int) -> list[int]:
    """Distinct prompt lengths, spread so that every first N of them has about the same mean (37 is prime to 64)."""
    spread = 64
    while spread < sessions:
        spread *= 2
    return [SHORTEST_PREFILL + (index * 37 + spread // 2) % spread for index in range(sessions)]


def decode_rounds(options, dtype: str, cache_dir: Path) -> dict:
    """Decode rounds of the tiny model's span and of the benchmarked model's (bench.options.Options says which,
    on which device and how many sessions), by model name."""
    from bench.shapes import model_folder, shape_folder

    name, folder = model_folder(options.shape, dtype, cache_dir, options.device)
    models = {"tiny": shape_folder("tiny", dtype, cache_dir, options.device), name: folder}
    measured = {}
    for model, path in models.items():
        print(f"decode rounds of {model}'s blocks alone, {dtype} on {options.device}", file=sys.stderr, flush=True)
        measured[model] = measure_decode_rounds(path, options.device, getattr(torch, dtype), options.round_sessions,
                                                options.round_repeats)
    return measured


def measure_decode_rounds(folder: Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                          sessions: tuple[int, ...] = ROUND_SESSIONS, repeats: int = 10, warmup: int = 2,
                          min_seconds: float = MIN_TIMED_SECONDS) -> dict:
    """Milliseconds per decode round of the whole model's blocks for each count of sessions, and the ratio of
    64 sessions (or the most measured) to 1."""
    from swarm.server.span import load_span
    from swarm.weights import load_config

    blocks = load_config(folder).num_hidden_layers
    span = load_span(folder, 0, blocks, device=device, dtype=dtype)
    lengths = prefill_lengths(max(sessions))
    caches = []
    try:
        for length in lengths:
            caches.append(span.new_cache(1, capacity=length + 1))
            _prefill(span, caches[-1], length)
        seconds = _alternate_rounds(span, caches, lengths, sessions, (warmup, repeats), min_seconds)
    finally:
        for cache in caches:
            cache.release()
        del span
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return summarize_rounds(seconds, blocks, lengths)


def _alternate_rounds(span, caches: list, lengths: list[int], sessions: tuple[int, ...], warmup_and_repeats,
                      min_seconds: float) -> dict[int, list[float]]:
    """Each count of sessions in turn, repeat after repeat: at least `repeats` timed rounds each, and more while
    less than min_seconds were timed (cheap rounds: a steadier median where noise comes in bursts)."""
    warmup, repeats = warmup_and_repeats
    seconds: dict[int, list[float]] = {count: [] for count in sessions}
    timed, repeat = 0.0, 0
    while repeat < warmup + repeats or (timed < min_seconds and repeat < warmup + MAX_REPEATS):
        for count in sessions:
            elapsed = _timed_round(span, caches[:count], lengths[:count])
            if repeat >= warmup:
                seconds[count].append(elapsed)
                timed += elapsed
        repeat += 1
    return seconds


def summarize_rounds(seconds: dict[int, list[float]], blocks: int, lengths: list[int]) -> dict:
    milliseconds = {str(count): statistics.median(times) * 1000 for count, times in seconds.items()}
    most = str(max(seconds))
    return {
        "blocks": f"0:{blocks}",
        "repeats": len(next(iter(seconds.values()))),
        "prefill_lengths": lengths,
        "ms_per_round": milliseconds,
        "ms_per_round_runs": {str(count): [time * 1000 for time in times] for count, times in seconds.items()},
        "ratio_most_to_one": milliseconds[most] / milliseconds["1"] if "1" in milliseconds else float("nan"),
        "most_sessions": int(most),
    }


def _prefill(span, cache, length: int) -> None:
    from swarm.server.attention import Segment

    hidden = torch.randn(1, length, span.config.hidden_size, device=span.device, dtype=span.dtype)
    span.forward_packed(hidden, [Segment(1, length, 0, cache)])


def _timed_round(span, caches: list, lengths: list[int]) -> float:
    """One decode round: a token for each session at its next position, in one packed forward; seconds."""
    from swarm.server.attention import Segment

    hidden = torch.randn(1, len(caches), span.config.hidden_size, device=span.device, dtype=span.dtype)
    segments = [Segment(1, 1, length, cache) for cache, length in zip(caches, lengths)]
    _synchronize(span.device)
    began = time.perf_counter()
    span.forward_packed(hidden, segments)
    _synchronize(span.device)
    return time.perf_counter() - began


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> None:
    """A quick run of this measurement alone, on the tiny model and on the chosen one."""
    from bench.report import decode_round_lines, decode_round_target
    from config import SwarmSettings

    options = parse_round_options(argv)
    torch.set_num_threads(options.threads)
    for dtype in options.dtypes:
        rounds = decode_rounds(options, dtype, SwarmSettings.from_env().cache_dir)
        print("\n".join([f"== {dtype} on {options.device}", *decode_round_lines(rounds),
                         "  " + decode_round_target(rounds, options.device).describe()]))


if __name__ == "__main__":
    main()
