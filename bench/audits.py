"""Audits after the fact (issue 41): the judge's calibration on honest servers, and what it detects of hostile ones.

    python -m bench.audits [--quick] [--rate R] [--session-tokens L] [--json bench/figures/audits.json]

One hop (blocks 10:20 of the default model; --quick: 1:3 of the tests' tiny model) built as servers build it
(load_span), on hidden states of real text (the repository's docs cut at 16 to 512 tokens, through the earlier
blocks in float32, rounded to bfloat16 as a bfloat16 hop sends them: the client keeps those inputs, an audit
sends the same). Honest servers: float32, bfloat16 and float16 spans, each by prefill alone, packed with other
sequences in one cache-less round, and by decode (a position per round with a cache, alone or beside other
sessions). Auditors: each dtype, prefill alone; a pair is judged at the coarser dtype (audit_judge.coarser).

Attacks run on the same hop, judged at bfloat16 (a liar declares what suits it) by every honest auditor. Traffic:
sessions of L tokens through the liar, each one's hop audited with probability r (an audit covers its L positions,
detecting with the p_L measured); caught within N tokens: 1 - (1 - r p_L)^(N / L) (a fraction of a session counts
as its share of tokens); median tokens to detection: L ln 2 / -ln(1 - r p_L)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import timeit
from pathlib import Path

import torch

from swarm.client.audit_judge import (FINGERPRINT_DIMS, GROSS_THRESHOLDS, PRECISIONS, SUBTLE_MIN_POSITIONS,
                                      SUBTLE_THRESHOLDS, coarser, fingerprint, judge, position_errors)

ROOT = Path(__file__).resolve().parent.parent
FULL = dict(model="SmolLM2-135M-Instruct", hop=(10, 20), skipped=15, lengths={16: 16, 64: 12, 256: 8, 512: 4})
QUICK = dict(model="tiny", hop=(1, 3), skipped=2, lengths={16: 4, 64: 2})
DTYPES = ("float32", "bfloat16", "float16")
MARGINS = dict(gross=3.0, subtle=1.5)  # thresholds: the honest maximum observed x these
FLOORS = dict(gross=1e-4, subtle=1e-4)  # float32 agrees to 1e-6 on one CPU; other kernels sum in other orders
SUBTLE_BUCKETS = (SUBTLE_MIN_POSITIONS, 16, 64, 256)  # honest means by T, from each of these to the next
Z_ONE_IN_A_MILLION = 4.753  # a normal's one-sided 1e-6 quantile
NOISE_REPEATS = 10  # draws of each random lie per sequence
WINDOWS = (1, 100, 1000)
AUDIT_RATE = 0.3  # recommended: catches within 1000 tokens (0.99, sessions of 64) what one audit does (0.27 needed)
PREFIX_ENDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # each honest pair's prefixes judged: audits of their own


def model_folder(name: str) -> Path:
    if name == "tiny":  # built anew, as the tests build it
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_model import build_tiny_model

        return build_tiny_model(Path(tempfile.mkdtemp(prefix="audits-tiny-")), "llama", 4)
    from config import SwarmSettings
    from swarm.weights import resolve_model

    return resolve_model(name, SwarmSettings.from_env().cache_dir)


def prompt_ids(folder: Path, lengths: dict[int, int]) -> list[torch.Tensor]:
    """Token ids of real text, `count` cuts of each length from different places of the repository's docs."""
    from swarm.weights import load_tokenizer

    text = "\n\n".join(path.read_text() for path in sorted((ROOT / "docs").glob("*.md")))
    ids = torch.tensor(load_tokenizer(folder)(text)["input_ids"])
    cuts, offset = [], 0
    for length, count in lengths.items():
        for _ in range(count):
            offset = (offset + 7919) % (len(ids) - length)
            cuts.append(ids[offset: offset + length])
    return cuts


@torch.inference_mode()
def hop_inputs(folder: Path, start: int, lengths: dict[int, int]) -> list[torch.Tensor]:
    """(1, T, hidden) inputs of blocks start:..: the earlier blocks' float32 outputs, rounded to bfloat16."""
    from swarm.client.head import load_client
    from swarm.server.span import load_span

    client, front = load_client(folder), load_span(folder, 0, start)
    return [front(client.embed(ids[None])).to(torch.bfloat16) for ids in prompt_ids(folder, lengths)]


def prefill(span, sequence: torch.Tensor) -> torch.Tensor:
    """An audit's forward: the whole sequence at once, cache-less, alone."""
    return span(sequence).float()[0]


def packed_prefill(span, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """Cache-less sequences of several lengths packed in one round, as the server's batching does."""
    from swarm.server.attention import Segment

    packed = torch.cat([sequence[0] for sequence in sequences])[None]
    segments = [Segment(1, sequence.shape[1], 0, None) for sequence in sequences]
    outputs = span.forward_packed(packed, segments).float()[0]
    return list(outputs.split([sequence.shape[1] for sequence in sequences]))


def decode(span, sequences: list[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
    """Sessions stepped one position per round with their caches, all of them in each round while they last (one
    sequence: a session alone); their outputs, and the seconds the rounds took."""
    from swarm.server.attention import Segment

    caches = [span.new_cache(1, sequence.shape[1]) for sequence in sequences]
    outputs = [[] for _ in sequences]
    began = timeit.default_timer()
    for position in range(max(sequence.shape[1] for sequence in sequences)):
        live = [index for index, sequence in enumerate(sequences) if position < sequence.shape[1]]
        for index in live:
            caches[index].prepare(position, position + 1)
        packed = torch.cat([sequences[index][:, position] for index in live])[None]
        segments = [Segment(1, 1, position, caches[index]) for index in live]
        for index, output in zip(live, span.forward_packed(packed, segments).float()[0]):
            outputs[index].append(output)
    seconds = timeit.default_timer() - began
    for cache in caches:
        cache.release()
    return [torch.stack(rows) for rows in outputs], seconds


def honest_claims(folder: Path, hop: tuple[int, int], inputs: list[torch.Tensor]) -> dict:
    """(dtype, mode) -> outputs per sequence of honest servers (decode: every other sequence of each length, half
    of them alone, half beside another session: decoding is slow on a CPU), and decode seconds of those alone."""
    from swarm.server.span import load_span

    claims, decode_seconds = {}, {}
    for dtype in DTYPES:
        span = load_span(folder, *hop, dtype=getattr(torch, dtype))
        claims[dtype, "prefill"] = [prefill(span, sequence) for sequence in inputs]
        packed = {index: out for group in _groups(range(len(inputs)), 3)
                  for index, out in zip(group, packed_prefill(span, [inputs[index] for index in group]))}
        claims[dtype, "packed"] = [packed[index] for index in range(len(inputs))]
        alone, batched = range(0, len(inputs), 4), range(2, len(inputs), 4)
        outputs = {}
        for group in [[index] for index in alone] + _groups(batched, 2):
            decoded, seconds = decode(span, [inputs[index] for index in group])
            outputs.update(zip(group, decoded))
            if len(group) == 1 and dtype == "float32":
                decode_seconds[group[0]] = seconds
        claims[dtype, "decode"] = [outputs.get(index) for index in range(len(inputs))]
        print(f"honest {dtype}: prefill, packed and decode done", file=sys.stderr, flush=True)
    return claims, decode_seconds


def _groups(indices, size: int) -> list[list[int]]:
    """Groups of about `size`, each taking every n-th index: sequences of different lengths side by side."""
    indices = list(indices)
    count = -(-len(indices) // size)
    return [indices[first::count] for first in range(count)]


def honest_pairs(claims: dict):
    """(precision, claimed fingerprints, auditor's fingerprints) of every honest pair: each server's outputs of
    each sequence against each auditor's prefill, but a server against itself (bit for bit: nothing learned)."""
    for (dtype, mode), outputs in claims.items():
        for auditor in [auditor for auditor in DTYPES if (dtype, mode) != (auditor, "prefill")]:
            for claimed, recomputed in zip(outputs, claims[auditor, "prefill"]):
                if claimed is not None:  # a sequence not decoded
                    yield coarser(dtype, auditor), fingerprint(claimed), fingerprint(recomputed)


def calibrate(claims: dict) -> tuple[dict, dict]:
    """Per precision: honest pairs' position errors and the means of their prefixes (each: the audit of a session
    that ended there), the thresholds they suggest, and the fitted chance that an honest audit crosses the shipped
    ones (_gross_figures, _subtle_figures); and the false positives of the shipped judge on every prefix."""
    errors, means = {name: [] for name in PRECISIONS}, {name: [] for name in PRECISIONS}
    verdicts = []
    for precision, claimed, recomputed in honest_pairs(claims):
        sequence_errors = position_errors(claimed, recomputed)
        errors[precision].append(sequence_errors)
        ends = sorted({end for end in (*PREFIX_ENDS, len(claimed)) if end <= len(claimed)})
        means[precision] += [(end, float(sequence_errors[:end].mean())) for end in ends]
        verdicts += [judge(claimed[:end], recomputed[:end], precision) for end in ends]
    figures = {precision: dict(**_gross_figures(torch.cat(errors[precision]), precision),
                               subtle=_subtle_figures(means[precision], precision)) for precision in PRECISIONS}
    return figures, dict(honest_audits=len(verdicts), false_positives=sum(not verdict.honest for verdict in verdicts),
                         honest_positions_compared=sum(len(every) for rows in errors.values() for every in rows),
                         worst_score=max(verdict.score for verdict in verdicts))


def _gross_figures(every: torch.Tensor, precision: str) -> dict:
    """Honest e_t's maximum and quantiles, the threshold they suggest, and a log-normal fit's P(e_t > shipped)."""
    median, q999 = torch.quantile(every, torch.tensor([0.5, 0.999], dtype=every.dtype)).tolist()
    return dict(positions=len(every), max_error=float(every.max()), median_error=median, q999_error=q999,
                gross_threshold=max(MARGINS["gross"] * float(every.max()), FLOORS["gross"]),
                fitted_gross_fp_per_position=_tail(math.log(GROSS_THRESHOLDS[precision]), every[every > 0].log()))


def _subtle_figures(means: list[tuple[int, float]], precision: str) -> dict:
    """Per bucket of T: the honest means at its shortest T (mean, std), the largest at any T in it, the threshold
    they suggest (a normal fit's 1e-6 quantile, at least MARGINS x the largest, at least FLOORS), and the fitted
    chance that an audit of the bucket's shortest T crosses the shipped one."""
    figures = {}
    for fewest, bound in zip(SUBTLE_BUCKETS, (*SUBTLE_BUCKETS[1:], math.inf)):
        shortest = torch.tensor([mean for end, mean in means if end == fewest], dtype=torch.float64)
        if len(shortest) < 2:  # no sequence that long (--quick)
            continue
        largest = max(mean for end, mean in means if fewest <= end < bound)
        fitted = float(shortest.mean() + Z_ONE_IN_A_MILLION * shortest.std())
        figures[fewest] = dict(audits=len(shortest), mean=float(shortest.mean()), std=float(shortest.std()),
                               max_mean=largest, threshold=max(fitted, MARGINS["subtle"] * largest, FLOORS["subtle"]),
                               fitted_fp_per_audit=_tail(SUBTLE_THRESHOLDS[precision], shortest))
    return figures


def _tail(threshold: float, values: torch.Tensor) -> float:
    """P(X > threshold) for X normal with the values' mean and standard deviation."""
    return 0.5 * math.erfc((threshold - float(values.mean())) / float(values.std()) / math.sqrt(2))


def edited_span(folder: Path, hop: tuple[int, int], edit=None, quantization=None):
    """The hop's span with every weight matrix passed through edit(matrix, generator), or quantized."""
    from swarm.server.span import load_span

    span, generator = load_span(folder, *hop, quantization=quantization), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in span.parameters():
            if edit is not None and parameter.ndim >= 2:
                edit(parameter, generator)
    return span


def perturbed(scale: float):
    """Another checkpoint of the same shape: N(0, scale x the tensor's std) added to every matrix."""
    def edit(matrix, generator):
        matrix.add_(torch.randn(matrix.shape, generator=generator) * matrix.std() * scale)
    return edit


def low_rank(rank: int, relative: float):
    """A fine-tune-like delta: a random rank-`rank` matrix of Frobenius norm `relative` x the weight's."""
    def edit(matrix, generator):
        delta = torch.randn(matrix.shape[0], rank, generator=generator) @ torch.randn(rank, matrix.shape[1],
                                                                                     generator=generator)
        matrix.add_(delta * (relative * matrix.norm() / delta.norm()))
    return edit


def skipping(span, skipped: int):
    """The hop without block `skipped` (a server saving a tenth of its compute)."""
    def run(sequence):
        hidden = span(sequence, start=span.start, end=skipped) if span.start < skipped else sequence
        return (span(hidden, start=skipped + 1, end=span.end) if skipped + 1 < span.end else hidden).float()[0]
    return run


def noisy(honest: torch.Tensor, scale: float, generator, where=None) -> torch.Tensor:
    """Gaussian noise of norm about scale x each position's (at the positions `where`, if given)."""
    noise = torch.randn(honest.shape, generator=generator) * honest.norm(dim=-1, keepdim=True) / honest.shape[-1] ** .5
    # at `where`: random vectors of the honest norm
    return honest + scale * noise if where is None else torch.where(where[:, None], noise, honest)


def attacks(folder: Path, hop: tuple[int, int], skipped: int) -> dict:
    """name -> (claim(sequence, honest outputs, generator) -> claimed outputs, whether it is random)."""
    def by_span(span):
        return lambda sequence, honest, generator: prefill(span, sequence)

    skip = skipping(edited_span(folder, hop), skipped)
    table = {
        "random weights": (by_span(edited_span(folder, hop, lambda matrix, generator: matrix.copy_(
            torch.randn(matrix.shape, generator=generator) * matrix.std()))), False),
        "checkpoint +N(0, 0.01 std)": (by_span(edited_span(folder, hop, perturbed(1e-2))), False),
        "checkpoint +N(0, 0.001 std)": (by_span(edited_span(folder, hop, perturbed(1e-3))), False),
        "fine-tune rank 16, 1% norm": (by_span(edited_span(folder, hop, low_rank(16, 1e-2))), False),
        "int8 weights": (by_span(edited_span(folder, hop, quantization="int8")), False),
        "nf4 weights": (by_span(edited_span(folder, hop, quantization="nf4")), False),
        f"block {skipped} skipped": (lambda sequence, honest, generator: skip(sequence), False),
        # honest on the prompt (the first half: prefilled), lying on the generated positions (decoded)
        "decode lies (block skipped)": (lambda sequence, honest, generator: torch.cat(
            [honest[: len(honest) // 2], skip(sequence)[len(honest) // 2:]]), False),
        "lie on 1% of positions": (lambda sequence, honest, generator: noisy(
            honest, 1.0, generator, torch.rand(len(honest), generator=generator) < 0.01), True),
    }
    return table | {f"noise {scale:g}": (lambda sequence, honest, generator, scale=scale: noisy(
        honest, scale, generator), True) for scale in (1e-1, 1e-2, 1e-3)}


def detection(claims: dict, inputs: list[torch.Tensor], table: dict) -> dict:
    """name -> precision -> {T: the probability that one audit of T positions flags the attack}: each sequence
    of T positions (NOISE_REPEATS draws of a random attack) against each honest auditor's prefill, judged at
    bfloat16 (a liar declares the loosest dtype); and against a float32 auditor at float32 (declaring float32)."""
    honest, found = claims["float32", "prefill"], {}
    for name, (claim, is_random) in table.items():
        flags = {"bfloat16": {}, "float32": {}}
        generator = torch.Generator().manual_seed(41)
        for index, sequence in enumerate(inputs):
            for _ in range(NOISE_REPEATS if is_random else 1):
                claimed = fingerprint(claim(sequence, honest[index], generator))
                for auditor in DTYPES:
                    for precision in ["bfloat16"] + (["float32"] if auditor == "float32" else []):
                        verdict = judge(claimed, fingerprint(claims[auditor, "prefill"][index]), precision)
                        flags[precision].setdefault(len(sequence[0]), []).append(not verdict.honest)
        found[name] = {precision: {length: sum(flagged) / len(flagged) for length, flagged in sorted(rows.items())}
                       for precision, rows in flags.items()}
        print(f"attack {name}: {found[name]}", file=sys.stderr, flush=True)
    return found


def traffic(p_audit: float, rate: float, session_tokens: int) -> dict:
    """Detection within WINDOWS tokens, the median tokens to detection (module docstring's model), and the audit
    rate that would catch the attack within 1000 tokens with probability 0.99."""
    per_session = rate * p_audit
    within = {tokens: 1 - (1 - per_session) ** (tokens / session_tokens) for tokens in WINDOWS}
    median = math.inf if per_session <= 0 else (
        session_tokens if per_session >= 1 else session_tokens * math.log(2) / -math.log1p(-per_session))
    needed = math.inf if p_audit <= 0 else (1 - 0.01 ** (session_tokens / 1000)) / p_audit
    return dict(within=within, median_tokens=median, rate_needed=needed)


def costs(folder: Path, hop: tuple[int, int], inputs: list[torch.Tensor], decode_seconds: dict, rate: float,
          session_tokens: int) -> dict:
    """An audit's prefill against the decode rounds it checks (float32, alone, this CPU, per T), bytes per token
    per hop, and what other rates would cost and catch (of an attack that one audit catches)."""
    from swarm.server.span import load_span

    span, seconds = load_span(folder, *hop), {}
    for index, decoding in decode_seconds.items():  # the least disturbed of 3 prefills
        prefilling = min(timeit.repeat(lambda: prefill(span, inputs[index]), number=1, repeat=3))
        totals = seconds.setdefault(inputs[index].shape[1], [0.0, 0.0])
        totals[0], totals[1] = totals[0] + prefilling, totals[1] + decoding
    ratios = {length: dict(prefill_s=prefilling, decode_s=decoding, ratio=prefilling / decoding)
              for length, (prefilling, decoding) in sorted(seconds.items())}
    ratio = ratios[min(ratios, key=lambda length: abs(length - session_tokens))]["ratio"]
    hidden_bytes, kept = 2 * inputs[0].shape[-1], 4 * FINGERPRINT_DIMS  # an audit's inputs in bfloat16; replies: kept

    def at(rate: float) -> dict:
        return dict(extra_compute=rate * ratio, kept_bytes_per_token=kept, audit_wire_bytes_per_token=rate * (
            hidden_bytes + kept), caught_within_1000=traffic(1.0, rate, session_tokens)["within"][1000])
    return dict(prefill_vs_decode=ratios, **at(rate), by_rate={other: at(other) for other in (0.05, 0.1, 0.25, 0.5)})


def report(figures: dict) -> str:
    rate, tokens, cost, honest = (figures[key] for key in ("rate", "session_tokens", "costs", "false_positives"))
    lines = ["| precision | honest positions | max e_t | q99.9 e_t | suggested gross | fitted P(e_t > gross) | "
             "subtle by T: max mean, suggested, fitted P(audit > shipped) |", "|---" * 7 + "|"]
    for name, row in figures["calibration"].items():
        subtle = "; ".join(f"{fewest}: {bucket['max_mean']:.2e}, {bucket['threshold']:.2e}, "
                           f"{bucket['fitted_fp_per_audit']:.1e}" for fewest, bucket in row["subtle"].items())
        lines.append(f"| {name} | {row['positions']} | {row['max_error']:.2e} | {row['q999_error']:.2e} | "
                     f"{row['gross_threshold']:.2e} | {row['fitted_gross_fp_per_position']:.1e} | {subtle} |")
    lines += ["", f"Attacks: audit rate {rate:g}, sessions of {tokens} tokens, liar declaring bfloat16", "",
              "| attack | p(one audit) T=16 / 64 / 256 | same, liar declaring float32 | within 1 | within 100 | "
              "within 1000 | median tokens |", "|---" * 7 + "|"]
    for name, row in figures["attacks"].items():
        per_audit = [" / ".join(f"{by_length.get(length, math.nan):.2f}" for length in (16, 64, 256))
                     for by_length in (row["per_audit"]["bfloat16"], row["per_audit"]["float32"])]
        within = row["traffic"]["within"]
        lines.append(f"| {name} | {per_audit[0]} | {per_audit[1]} | {within[1]:.4f} | {within[100]:.3f} | "
                     f"{within[1000]:.3f} | {row['traffic']['median_tokens']:.0f} |")
    ratios = {length: round(row["ratio"], 3) for length, row in cost["prefill_vs_decode"].items()}
    lines += ["", f"False positives: {honest['false_positives']} in {honest['honest_audits']} honest audits "
              f"({honest['honest_positions_compared']} positions; worst score {honest['worst_score']:.2f} of 1)",
              f"An audit's prefill / the decode rounds it checks (seconds, by T): {ratios}",
              "", "| rate | extra compute | bytes kept per token per hop | audit wire bytes per token per hop | "
              "p(caught within 1000 tokens), one audit catching |", "|---" * 5 + "|"]
    lines += [f"| {other:g} | {row['extra_compute']:.2%} | {row['kept_bytes_per_token']} | "
              f"{row['audit_wire_bytes_per_token']:.0f} | {row['caught_within_1000']:.3f} |"
              for other, row in [(rate, cost), *cost["by_rate"].items()]]
    return "\n".join(lines + ["", f"Rate for 0.99 within 1000 tokens of every attack one audit catches (p >= 0.9): "
                                  f"{figures['needed_rate']:.3f}"])


def run(options) -> dict:
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # int8 on float32 inputs: said at every forward
    torch.set_num_threads(1)  # as the test suite's processes: figures less disturbed by other work on the machine
    setup, tokens = QUICK if options.quick else FULL, options.session_tokens
    folder = model_folder(setup["model"])
    inputs = hop_inputs(folder, setup["hop"][0], setup["lengths"])
    claims, decode_seconds = honest_claims(folder, setup["hop"], inputs)
    found = detection(claims, inputs, attacks(folder, setup["hop"], setup["skipped"]))
    figures = dict(model=setup["model"], hop=setup["hop"], rate=options.rate, session_tokens=tokens,
                   **dict(zip(("calibration", "false_positives"), calibrate(claims))))

    def at_session_length(row: dict) -> float:  # the audit's detection at the length nearest the sessions'
        return row["bfloat16"][min(row["bfloat16"], key=lambda length: abs(length - tokens))]

    figures["attacks"] = {name: dict(per_audit=row, traffic=traffic(at_session_length(row), options.rate, tokens))
                          for name, row in found.items()}
    figures["needed_rate"] = max([row["traffic"]["rate_needed"] for row in figures["attacks"].values()
                                  if at_session_length(row["per_audit"]) >= 0.9], default=0.0)
    figures["costs"] = costs(folder, setup["hop"], inputs, decode_seconds, options.rate, tokens)
    return figures


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model's blocks 1:3, few sequences")
    parser.add_argument("--rate", type=float, default=AUDIT_RATE, help="audit probability per session and hop")
    parser.add_argument("--session-tokens", type=int, default=64, help="tokens of each session through the hop")
    parser.add_argument("--json", type=Path, help="default: bench/figures/audits.json (none with --quick)")
    options = parser.parse_args(argv)
    figures = run(options)
    print(report(figures))
    if options.json or not options.quick:
        (options.json or ROOT / "bench" / "figures" / "audits.json").write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
