"""The benchmark's command lines: `python -m bench` (the whole suite) and `python -m bench.span_round` (one
decode round of a span alone), their flags, and the defaults a CPU and a GPU run start from."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from bench.shapes import SHAPES

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DTYPES = ("float32", "bfloat16", "float16")
# --quick: a smoke run of every measurement in a few minutes; fewer tokens and rounds, fewer sessions
FULL = {"tokens": 128, "rounds": 3, "concurrency": (1, 4, 16, 64), "concurrency_tokens": 64, "round_repeats": 10}
QUICK = {"tokens": 32, "rounds": 1, "concurrency": (1, 4), "concurrency_tokens": 16, "round_repeats": 5}
# a GPU's batches are cheap up to many more rows: its levels reach further, and 16-bit is its native dtype
GPU_CONCURRENCY = {"full": (1, 8, 32, 64), "quick": (1, 8)}
DEFAULT_DTYPES = {"cpu": ("float32",), "cuda": ("bfloat16",)}
ROUND_SESSIONS = (1, 8, 32, 64)  # sessions per decode round of the span alone (bench/span_round.py)
# verify rounds of the span alone: each session's step carries 1 + a draft of k tokens (the gateway drafts up to
# SPECULATIVE_TOKENS, 8 by default; prompt lookup's drafts are often shorter)
ROUND_DRAFTS = (4, 8)
# the span's own cache pool (no server sized it) holds 64 sessions of the decode rounds' lengths
MOST_ROUND_SESSIONS = 64


@dataclass(frozen=True)
class Options:
    tokens: int  # new tokens of each single-session reply
    rounds: int  # timed rounds of the single-session measurements
    concurrency: tuple[int, ...]  # simultaneous sessions, one run each
    concurrency_tokens: int  # new tokens of each session in the concurrency runs
    threads: int  # torch threads in every process: this one, each server, the gateway
    dtypes: tuple[str, ...]  # one whole run of the suite each
    timeout: float  # seconds: the most any one reply or concurrency run may take
    device: str = "cpu"  # block servers, the local baseline and the gateway's embeddings and LM head
    shape: Optional[str] = None  # a named shape with random weights (bench/shapes.py); None: the default model
    round_sessions: tuple[int, ...] = ROUND_SESSIONS  # sessions per decode round of the span alone
    round_repeats: int = 10  # timed decode rounds per count of sessions
    round_drafts: tuple[int, ...] = ROUND_DRAFTS  # draft tokens of the span alone's verify rounds
    # draft tokens per step on every single-session path (0: plain decoding): the gateway's SPECULATIVE_TOKENS,
    # the Python client's prompt lookup and local generate's prompt_lookup_num_tokens
    speculative_tokens: int = 0


def count_list(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, e.g. 1,8,32,64; got {text!r}")
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"every count of sessions must be at least 1; got {text!r}")
    return tuple(sorted(set(counts)))


def round_counts(text: str) -> tuple[int, ...]:
    counts = count_list(text)
    if max(counts) > MOST_ROUND_SESSIONS:
        raise argparse.ArgumentTypeError(f"at most {MOST_ROUND_SESSIONS} sessions per round; got {text!r}")
    return counts


def draft_counts(text: str) -> tuple[int, ...]:
    from config import MAX_SPECULATIVE_TOKENS

    counts = count_list(text)
    if max(counts) > MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"at most {MAX_SPECULATIVE_TOKENS} draft tokens; got {text!r}")
    return counts


def speculative_tokens(text: str) -> int:
    from config import MAX_SPECULATIVE_TOKENS

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if not 0 <= value <= MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"must be between 0 and {MAX_SPECULATIVE_TOKENS}, got {value}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def dtype_list(text: str) -> tuple[str, ...]:
    dtypes = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    unknown = [dtype for dtype in dtypes if dtype not in DTYPES]
    if unknown or not dtypes:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(DTYPES)}, separated by commas; got {text!r}")
    return dtypes


def device_name(text: str) -> str:
    """cpu or cuda, checked against this machine before anything starts."""
    if text not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu or cuda, got {text!r}")
    if text == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("cuda asked for, but CUDA is not available on this machine")
    return text


def _common_flags(parser) -> None:
    parser.add_argument("--device", type=device_name, default="cpu",
                        help="cpu (default) or cuda: block servers, the local baseline, the gateway's head")
    parser.add_argument("--dtype", type=dtype_list, help="one run per dtype, e.g. float32,bfloat16 "
                        "(default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a model of this shape with random weights, built "
                        "once into the cache (default: the default model)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads in every process (default 1)")
    parser.add_argument("--round-sessions", type=round_counts, default=ROUND_SESSIONS,
                        help="sessions per decode round of the span alone (default 1,8,32,64)")
    parser.add_argument("--round-drafts", type=draft_counts, default=ROUND_DRAFTS,
                        help="the span alone's verify rounds: draft tokens per session's step, each k a round "
                             "of 1 + k positions per session (default 4,8)")


def parse_options(argv=None) -> tuple[Options, Path]:
    """`python -m bench`'s command line -> the run's options and the folder for its JSON and plot."""
    from swarm.cli import ArgumentParser

    parser = ArgumentParser(prog="python -m bench", description="The whole benchmark suite in one run.")
    parser.add_argument("--quick", action="store_true", help="a smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    parser.add_argument("--tokens", type=positive_int, help=f"new tokens per single-session reply (default {FULL['tokens']})")
    parser.add_argument("--rounds", type=positive_int, help=f"alternating timed rounds (default {FULL['rounds']})")
    parser.add_argument("--concurrency", type=count_list, help="simultaneous sessions to run, e.g. 1,8,32,64 "
                        "(default 1,4,16,64 on cpu, 1,8,32,64 on cuda)")
    parser.add_argument("--concurrency-tokens", type=positive_int,
                        help=f"new tokens per session in the concurrency runs (default {FULL['concurrency_tokens']})")
    parser.add_argument("--round-repeats", type=positive_int, help="timed decode rounds of the span alone per count "
                        f"of sessions (default {FULL['round_repeats']})")
    _common_flags(parser)
    parser.add_argument("--speculative-tokens", type=speculative_tokens, default=0,
                        help="single sessions draft up to N tokens per step by prompt lookup on every path: the "
                             "gateway (SPECULATIVE_TOKENS), the Python client and local generate (default 0: "
                             "plain decoding everywhere)")
    parser.add_argument("--bfloat16", action="store_true", help="the same as --dtype float32,bfloat16")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds any one reply or concurrency run may take before it is cut (default 300)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for the JSON and the plot")
    args = parser.parse_args(argv)

    defaults = dict(QUICK if args.quick else FULL)
    if args.device == "cuda":
        defaults["concurrency"] = GPU_CONCURRENCY["quick" if args.quick else "full"]
    chosen = {name: getattr(args, name) if getattr(args, name) is not None else default
              for name, default in defaults.items()}
    dtypes = args.dtype or (("float32", "bfloat16") if args.bfloat16 else DEFAULT_DTYPES[args.device])
    return Options(**chosen, threads=args.threads, timeout=args.timeout, dtypes=dtypes, device=args.device,
                   shape=args.shape, round_sessions=args.round_sessions, round_drafts=args.round_drafts,
                   speculative_tokens=args.speculative_tokens), args.out


def parse_round_options(argv=None) -> Options:
    """`python -m bench.span_round`'s command line: the suite's options that the decode rounds read."""
    from swarm.cli import ArgumentParser

    parser = ArgumentParser(prog="python -m bench.span_round",
                            description="One decode round of a span alone, on the tiny model and the chosen one.")
    _common_flags(parser)
    parser.add_argument("--round-repeats", type=positive_int, default=FULL["round_repeats"],
                        help=f"timed rounds per count of sessions (default {FULL['round_repeats']})")
    args = parser.parse_args(argv)
    # no swarm runs: the suite's other options stay empty
    return Options(tokens=0, rounds=0, concurrency=(), concurrency_tokens=0, threads=args.threads, timeout=0.0,
                   dtypes=args.dtype or DEFAULT_DTYPES[args.device], device=args.device, shape=args.shape,
                   round_sessions=args.round_sessions, round_repeats=args.round_repeats,
                   round_drafts=args.round_drafts)
