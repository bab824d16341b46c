"""`python -m bench.lora`: what LoRA adapters cost a block server's decode round (docs/benchmarks.md's adapter figures).

    python -m bench.lora [--shape NAME] [--device cpu|cuda] [--dtype float32] [--threads 1] [--sessions 16]
                         [--rank 16] [--repeats 30]

Loads the model's blocks (swarm.server.span.load_span: the default model, or a random-weight shape), gives them
four random LoRA adapters of rank --rank on q, k, v and o (written as PEFT saves them, read as a server reads
them: swarm/server/adapters.py), prefills --sessions sessions, and times decode rounds of all of them in one
packed forward, the sessions going through: no adapter; one adapter; four adapters (a quarter each); half one
adapter, half none. Rounds alternate between the mixes, repeat after repeat; the figure is the median, and each
mix's ratio to the round without adapters. Prints a Markdown table; exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTERS = ("lora-0", "lora-1", "lora-2", "lora-3")


def write_adapter(span, folder: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA folder for the span's blocks (A and B both non-zero: every delta is computed)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for index, layer in zip(range(span.start, span.end), span.layers):
        for target in TARGETS:
            linear = layer.self_attn.get_submodule(target)
            key = f"base_model.model.{span.family.layer_key.format(index)}self_attn.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, linear.in_features, generator=generator) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(linear.out_features, rank, generator=generator) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def mixes(sessions: int) -> dict[str, list]:
    """Which adapter each session of a round goes through, per mix."""
    return {
        "no adapter": [None] * sessions,
        "one adapter": [ADAPTERS[0]] * sessions,
        "four adapters": [ADAPTERS[index % 4] for index in range(sessions)],
        "half one adapter, half none": [ADAPTERS[0] if index % 2 else None for index in range(sessions)],
    }


def measure(folder: Path, options) -> dict[str, float]:
    """Median milliseconds per decode round of each mix."""
    from swarm.server.adapters import attach_adapters, read_adapter
    from swarm.server.attention import Segment
    from swarm.server.span import load_span
    from swarm.weights import load_config

    blocks = load_config(folder).num_hidden_layers
    span = load_span(folder, 0, blocks, device=options.device, dtype=getattr(torch, options.dtype))
    with tempfile.TemporaryDirectory() as adapters:
        attach_adapters(span, [read_adapter(write_adapter(span, Path(adapters) / name, options.rank, seed))
                               for seed, name in enumerate(ADAPTERS)])
    lengths = [24 + (index * 37) % 64 for index in range(options.sessions)]
    caches = [span.new_cache(1, capacity=length + 1) for length in lengths]
    for cache, length in zip(caches, lengths):
        span.forward_packed(torch.randn(1, length, span.config.hidden_size, device=span.device, dtype=span.dtype),
                            [Segment(1, length, 0, cache)])
    seconds: dict[str, list[float]] = {mix: [] for mix in mixes(options.sessions)}
    for repeat in range(options.repeats + 2):  # two warm-up rounds per mix
        for mix, adapters in mixes(options.sessions).items():
            segments = [Segment(1, 1, length, cache, adapter)
                        for cache, length, adapter in zip(caches, lengths, adapters)]
            hidden = torch.randn(1, len(segments), span.config.hidden_size, device=span.device, dtype=span.dtype)
            _synchronize(span.device)
            began = time.perf_counter()
            span.forward_packed(hidden, segments)
            _synchronize(span.device)
            if repeat >= 2:
                seconds[mix].append(time.perf_counter() - began)
    return {mix: statistics.median(times) * 1000 for mix, times in seconds.items()}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> None:
    from bench.shapes import model_folder
    from config import SwarmSettings

    parser = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", help="a random-weight shape of bench.shapes (default: the default model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=30)
    options = parser.parse_args(argv)
    torch.set_num_threads(options.threads)
    name, folder = model_folder(options.shape, options.dtype, SwarmSettings.from_env().cache_dir, options.device)
    milliseconds = measure(folder, options)
    print(f"Decode rounds of {options.sessions} sessions through {name}'s blocks, {options.dtype} on "
          f"{options.device}, LoRA rank {options.rank} on {', '.join(TARGETS)} (median of {options.repeats}):\n")
    print("| sessions go through | ms per round | vs no adapter |\n|---|---|---|")
    for mix, value in milliseconds.items():
        print(f"| {mix} | {value:.1f} | {value / milliseconds['no adapter']:.2f}x |")


if __name__ == "__main__":
    main()
