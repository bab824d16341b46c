"""One round of a span alone: what each session adds to a block server's round, with no RPC, no batching
thread and no client in the way; decode rounds and verify rounds, eagerly and through the graphs servers run.

    python -m bench.span_round [--shape NAME] [--device cpu|cuda] [--dtype float32] [--threads 1]
                               [--round-sessions 1,8,32,64] [--round-drafts 4,8] [--round-repeats 10]

The model's blocks are loaded with swarm.server.span.load_span; 64 sessions (span.new_cache) are prefilled
to 64 different lengths (40, 13, 50, ...: any first N of them average about the same length); then a
round feeds the first N sessions in one span.forward_packed over N segments (swarm.server.attention.Segment),
at each session's next position. Every round writes the same positions again, so every repeat does the same
work. Kinds of round (round_kinds):

    decode       one new position per session (Segment(1, 1, length, cache))
    verify 1+k   1 + k positions per session: the pending token and a k-token draft being verified, as a
                 speculating gateway sends them (--round-drafts: k = 4 and 8)
    eager        the span without graphs: every kernel issued from Python, as servers without CUDA graphs run
    graphed      through the span's DecodeGraphs (span.use_graphs), what a server on CUDA runs: captured CUDA
                 graphs replayed (captured in the warm-up rounds, as a server captures ahead of its first
                 request); on a CPU, which has no CUDA graph, use_graphs(capture=False): the same padded rounds
                 run eagerly, and the report says so

Each kind's timed rounds are counted by the path they took, from the servers' own counters in this process
(swarm_server_graph_rounds_total, swarm_server_eager_rounds_total by reason): a graphed kind whose rounds fell
back to the eager path (a shape graphs.py does not take, a failed capture) shows it. Rounds alternate between
kinds and session counts, repeat after repeat, so that noise on a shared machine hits each alike; cheap rounds
repeat for a few seconds at least (MIN_TIMED_SECONDS per kind); the figure is the median.

A round's cost that grows with N only through its matrix products (N rows instead of 1, the weights read once)
is what batching promises; per-session work (Python per segment, one attention call per session) shows as a
ratio of 64 sessions to 1 well above what the arithmetic needs. The target, on the eager decode round: <= 3x
on the tiny model on a CPU.

Beside it, a reference (one_row_against_transformers): one row's decode round of the span against the same
layers run by transformers itself (the model's own decoder layers built from the same folder, its rotary and
causal mask, over its DynamicCache, at the same position), alternately, eagerly on whatever device. A round's
fixed cost (packing, planning, masks, our attention over the page pool) is what a server adds to its layers; the
target: one row's round <= 1.2x transformers' layers. (On a GPU the fair reference would be transformers'
layers in one CUDA graph over a StaticCache: not written; the GPU figure is eager against eager.)
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.options import ROUND_DRAFTS, ROUND_SESSIONS, parse_round_options
from bench.usage import RoundCounters, round_counters

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
        # the reference loads the whole model a second time: only the tiny one's (the round targets are its)
        measured[model] = measure_decode_rounds(path, options.device, getattr(torch, dtype), options.round_sessions,
                                                options.round_repeats, drafts=options.round_drafts,
                                                reference=model == "tiny")
    return measured


def measure_decode_rounds(folder: Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                          sessions: tuple[int, ...] = ROUND_SESSIONS, repeats: int = 10, warmup: int = 2,
                          min_seconds: float = MIN_TIMED_SECONDS, drafts: tuple[int, ...] = ROUND_DRAFTS,
                          reference: bool = True) -> dict:
    """Milliseconds per round of the whole model's blocks for each count of sessions and each kind of round
    (round_kinds), the ratio of 64 sessions (or the most measured) to 1, and the path each kind's rounds took;
    with `reference`, one row's round against transformers' own layers (one_row_against_transformers)."""
    from swarm.server.span import load_span
    from swarm.weights import load_config

    blocks = load_config(folder).num_hidden_layers
    span = load_span(folder, 0, blocks, device=device, dtype=dtype)
    lengths = prefill_lengths(max(sessions))
    kinds = round_kinds(drafts)
    capture = torch.device(device).type == "cuda"  # a CPU has no CUDA graph: the same padded rounds, eagerly
    caches, rounds = [], None
    try:
        for length in lengths:  # room for the longest verify step's positions
            caches.append(span.new_cache(1, capacity=length + 1 + max(drafts, default=0)))
            _prefill(span, caches[-1], length)
        span.use_graphs(capture)  # after the pool exists: the graphs' rounds hold its addresses
        rounds = Rounds(span, span.graphs, caches, lengths)
        # min_seconds of rounds per kind, as when the decode round was the only kind: each median as steady
        seconds = _alternate_rounds(rounds, sessions, kinds, (warmup, repeats), min_seconds * len(kinds))
        figures = summarize_kinds(seconds, rounds, blocks, lengths, capture)
        if reference:
            span.graphs = None  # the reference's comparison is with the eager round
            figures["one_row_vs_transformers"] = one_row_against_transformers(span, folder, caches[0], lengths[0],
                                                                              (warmup, repeats), min_seconds)
        return figures
    finally:
        for cache in caches:
            cache.release()
        span.graphs = None  # its captured rounds hold device memory, as the span does
        del span, caches, rounds  # before emptying the cache: nothing may hold the span's tensors then
        if capture:
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class RoundKind:
    """A round's kind: each session's segment has 1 + `draft` positions (0: a decode step; k: a verify step of a
    k-token draft), run through the span's DecodeGraphs (`graphed`) or eagerly (no graphs)."""

    draft: int
    graphed: bool

    @property
    def name(self) -> str:
        return f"{f'verify 1+{self.draft}' if self.draft else 'decode'} {'graphed' if self.graphed else 'eager'}"


def round_kinds(drafts: tuple[int, ...] = ROUND_DRAFTS) -> list[RoundKind]:
    return [RoundKind(draft, graphed) for draft in (0, *drafts) for graphed in (False, True)]


class Rounds:
    """A span's prefilled sessions, and the path each kind's timed rounds took: graphs replayed and eager rounds
    by reason, read from the servers' own counters (swarm.server.metrics) in this process around each round,
    so that the figures say what the span did, whatever graphs.py lets through."""

    def __init__(self, span, graphs, caches: list, lengths: list[int]):
        self.span, self.graphs, self.caches, self.lengths = span, graphs, caches, lengths
        self.graph_rounds: Counter[str] = Counter()  # kind -> its rounds that replayed a graph (or, on a CPU,
        # ran the graph's padded round eagerly: swarm_server_graph_rounds_total counts those too)
        self.eager_rounds: dict[str, Counter[str]] = defaultdict(Counter)  # kind -> reason -> rounds run eagerly

    def timed(self, kind: RoundKind, count: int, counted: bool) -> float:
        """One round of the first `count` sessions: seconds; with `counted`, its path is added to the kind's."""
        # forward_packed drops graphs that failed to capture: the graphed kinds then show eager rounds
        self.span.graphs = self.graphs if kind.graphed else None
        before = _round_counters()
        elapsed = _timed_round(self.span, self.caches[:count], self.lengths[:count], kind.draft)
        if counted:
            grown = _round_counters().since(before)
            self.graph_rounds[kind.name] += grown.graph_rounds or 0
            self.eager_rounds[kind.name].update(grown.eager_rounds or {})
        return elapsed


def _round_counters() -> RoundCounters:
    """This process's graphed and eager rounds so far (a counter not defined yet: not counted)."""
    from swarm.server import metrics

    found = [getattr(metrics, name, None) for name in ("GRAPH_ROUNDS", "EAGER_ROUNDS")]
    return round_counters(family for metric in found if metric is not None for family in metric.collect())


def _alternate_rounds(rounds: Rounds, sessions: tuple[int, ...], kinds: list[RoundKind], warmup_and_repeats,
                      min_seconds: float) -> dict[str, dict[int, list[float]]]:
    """Each kind and count of sessions in turn, repeat after repeat: at least `repeats` timed rounds each, and
    more while less than min_seconds were timed (cheap rounds: a steadier median where noise comes in bursts).
    The warm-ups capture the graphed kinds' graphs (on CUDA), as a server does ahead of its first request."""
    warmup, repeats = warmup_and_repeats
    seconds: dict[str, dict[int, list[float]]] = {kind.name: {count: [] for count in sessions} for kind in kinds}
    timed, repeat = 0.0, 0
    while repeat < warmup + repeats or (timed < min_seconds and repeat < warmup + MAX_REPEATS):
        for count in sessions:
            for kind in kinds:
                elapsed = rounds.timed(kind, count, counted=repeat >= warmup)
                if repeat >= warmup:
                    seconds[kind.name][count].append(elapsed)
                    timed += elapsed
        repeat += 1
    return seconds


def summarize_kinds(seconds: dict[str, dict[int, list[float]]], rounds: Rounds, blocks: int, lengths: list[int],
                    capture: bool) -> dict:
    """Every kind's figures (summarize_rounds's, and the path its rounds took) under `kinds`; the eager decode
    round's also at the top, as before verify rounds and graphs were measured (the round target reads them)."""
    kinds = {}
    for name, runs in seconds.items():
        figures = summarize_rounds(runs, blocks, lengths)
        kinds[name] = {**{key: value for key, value in figures.items() if key not in ("blocks", "prefill_lengths")},
                       "graph_rounds": rounds.graph_rounds[name], "eager_rounds": dict(rounds.eager_rounds[name])}
    return {**summarize_rounds(seconds[RoundKind(0, False).name], blocks, lengths), "captured": capture,
            "kinds": kinds}


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


# ---------------------------------------------------------------------- the reference: transformers' own layers


class TransformersLayers:
    """The same blocks run by transformers itself: the model's own decoder layers (built from the same folder:
    the same config and weights), its rotary embedding and causal mask, over its own DynamicCache, one row
    decoding at the session's next position, eagerly, as LlamaModel.forward runs them (without the embeddings
    and the final norm, which a span does not run either). What a span's round of one row should cost: the
    layers' own work and no more."""

    def __init__(self, folder: Path, device, dtype: torch.dtype, length: int):
        from transformers import AutoModelForCausalLM
        from transformers.cache_utils import DynamicCache

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        self.model, self.inner, self.length = model, model.model, length
        self.cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            self.decode(torch.randn(1, length, model.config.hidden_size, device=device, dtype=dtype), 0)

    @torch.inference_mode()
    def decode(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """hidden (1, positions, hidden) at `position` onwards through every layer, appended to the cache."""
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(position, position + hidden.shape[1], device=hidden.device)[None]
        mask = create_causal_mask(config=self.model.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=self.cache, position_ids=positions)
        rotary = self.inner.rotary_emb(hidden, position_ids=positions)
        for layer in self.inner.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions,
                           past_key_values=self.cache, use_cache=True)
        return hidden

    def timed_round(self) -> float:
        """One row's decode step at the session's next position; seconds. The cache is cut back after it
        (untimed), so that every round does the same work."""
        hidden = torch.randn(1, 1, self.model.config.hidden_size, device=self.model.device, dtype=self.model.dtype)
        _synchronize(hidden.device)
        began = time.perf_counter()
        self.decode(hidden, self.length)
        _synchronize(hidden.device)
        elapsed = time.perf_counter() - began
        self.cache.crop(-1)
        return elapsed


def one_row_against_transformers(span, folder: Path, cache, length: int, warmup_and_repeats,
                                 min_seconds: float) -> dict:
    """One session's decode round through the span (eagerly) and through transformers' own layers
    (TransformersLayers), alternately, at the same position: the medians in ms and their ratio (target: <= 1.2x,
    a server's round of one row costs what its layers cost)."""
    warmup, repeats = warmup_and_repeats
    reference = TransformersLayers(folder, span.device, span.dtype, length)
    times: dict[str, list[float]] = {"span": [], "transformers": []}
    repeat = 0
    while repeat < warmup + repeats or (sum(times["span"]) < min_seconds and repeat < warmup + 10 * MAX_REPEATS):
        measured = {"span": _timed_round(span, [cache], [length]), "transformers": reference.timed_round()}
        if repeat >= warmup:
            for name, elapsed in measured.items():
                times[name].append(elapsed)
        repeat += 1
    span_ms, reference_ms = (statistics.median(times[name]) * 1000 for name in ("span", "transformers"))
    return {"span_ms": span_ms, "transformers_ms": reference_ms, "ratio": span_ms / reference_ms,
            "repeats": len(times["span"]), "position": length, "reference": "eager"}


def one_row_lines(rounds: dict) -> list[str]:
    """The comparison of one row's round with transformers' layers, per model measured."""
    lines = ["", "one row's decode round, the span (eager) against transformers' own decoder layers over a "
                 "DynamicCache (eager), medians:"]
    for model, run in rounds.items():
        found = run.get("one_row_vs_transformers")
        if found:
            lines.append(f"  {model}: span {found['span_ms']:.3f} ms, transformers {found['transformers_ms']:.3f} ms"
                         f" at position {found['position']}: {found['ratio']:.2f}x (target <= 1.2x)")
    return lines


def _prefill(span, cache, length: int) -> None:
    from swarm.server.attention import Segment

    hidden = torch.randn(1, length, span.config.hidden_size, device=span.device, dtype=span.dtype)
    span.forward_packed(hidden, [Segment(1, length, 0, cache)])


def _timed_round(span, caches: list, lengths: list[int], draft: int = 0) -> float:
    """One round: each session's next 1 + `draft` positions (a decode step, or a verify step of a draft) in one
    packed forward; seconds."""
    from swarm.server.attention import Segment

    positions = 1 + draft
    hidden = torch.randn(1, len(caches) * positions, span.config.hidden_size, device=span.device, dtype=span.dtype)
    segments = [Segment(1, positions, length, cache) for cache, length in zip(caches, lengths)]
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
                         "  " + decode_round_target(rounds, options.device).describe(), *one_row_lines(rounds)]))


if __name__ == "__main__":
    main()
