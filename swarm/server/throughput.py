"""What a block server announces as its speed: decode steps through its span, timed once and remembered."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from swarm.server.span import BlockSpan

def cached_throughput(span: BlockSpan, folder, cache_dir) -> float:
    """measure_throughput, remembered on disk per model, span, device and dtype: a restart announces the
    figure at once (and a GPU box is not timed while it warms up)."""
    path = Path(cache_dir) / "throughput.json"
    key = (f"{Path(folder).resolve()}|{span.start}:{span.end}|{span.device}|{span.dtype}|{span.quantization}"
           f"|torch {torch.__version__}")
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known.get(key), (int, float)):
        known[key] = measure_throughput(span)
        known = dict(list(known.items())[-256:])  # the newest entries; old folders come and go
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".{os.getpid()}.tmp")  # servers starting together must not see half a file
        staging.write_text(json.dumps(known, indent=1))
        staging.replace(path)
    return float(known[key])


def measure_throughput(span: BlockSpan, repeats: int = 5) -> float:
    """Tokens per second of one decode step through the whole span (a median, after one warm-up)."""
    hidden = torch.zeros(1, 1, span.config.hidden_size, dtype=span.dtype, device=span.device)
    timings = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        span(hidden)
        if span.device.type == "cuda":
            torch.cuda.synchronize(span.device)
        timings.append(time.perf_counter() - began)
    return 1.0 / max(statistics.median(timings[1:]), 1e-9)
