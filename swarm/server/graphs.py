"""The decode fast path on CUDA: a span's decode round, captured once per shape bucket as a CUDA graph and
replayed, so that a round costs the GPU's time, not the CPU's time to issue hundreds of kernels.

A decode round (every segment one new position of a cached session) has the shapes of its group
(swarm/server/attention.py): n sequences, each attending to at most k keys. Rounds are padded up to a bucket
(n to a power of two up to 64, k to a power of two of at least 64), so a few graphs serve every round:

    the round's indices (CPU) --padded--> static tensors (GPU, copied in) --replay--> static output

Padding sequences read the pool's zero page, see only their first key (so their softmax stays finite) and
write to the pool's scratch page; their outputs are dropped. Everything else (prefill chunks, cache-less
forwards, rounds beyond the largest bucket, quantized spans) runs eagerly. On a CPU the same padded path can
run eagerly (`capture=False`), which is how the tests check it gives the eager round's outputs.

DecodeGraphs gets from its span (swarm/server/span.py) what a round needs: the pool, the span's first block,
and its forward over a built batch; this module never imports the span. When a round cannot be captured, the
graphs say so (`failed`) and the span runs eagerly from then on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch

from swarm.protocol import PAGE_TOKENS
from swarm.server.attention import Group, PackedBatch, Segment, group_sequences, token_positions
from swarm.server.cache import KVPool

logger = logging.getLogger(__name__)

SEQUENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_KEYS, MAX_KEYS = 64, 16384


def bucket(value: int, buckets) -> Optional[int]:
    return next((size for size in buckets if size >= value), None)


def key_bucket(keys: int) -> Optional[int]:
    size = MIN_KEYS
    while size < keys:
        size *= 2
    return size if size <= MAX_KEYS else None


@dataclass
class RoundTensors:
    """What a captured decode round reads besides the hidden states: positions and group indices, padded."""

    positions: torch.Tensor  # (n,)
    query_tokens: torch.Tensor  # (n, 1)
    key_index: torch.Tensor  # (n, pages)
    query_positions: torch.Tensor  # (n, 1)
    key_positions: torch.Tensor  # (keys,)
    key_valid: torch.Tensor  # (n, keys)
    destination: torch.Tensor  # (n,)
    write_slots: torch.Tensor  # (n,)

    def copy_from(self, other: "RoundTensors") -> None:
        for field in fields(self):
            getattr(self, field.name).copy_(getattr(other, field.name), non_blocking=True)

    def batch(self, pool, first_layer: int) -> PackedBatch:
        group = Group(True, self.query_tokens, self.key_index, self.query_positions, self.key_positions,
                      self.key_valid, None, self.destination, self.write_slots, decode_only=True)
        return PackedBatch(self.positions, [group], pool, first_layer)


def padded_round(segments: list[Segment], pool, sequences: int, keys: int) -> RoundTensors:
    """A decode round's inputs on the CPU, padded to `sequences` sequences and `keys` keys."""
    group = group_sequences(segments, pool, "cpu")[0]
    real, pages = group.key_index.shape
    extra, extra_pages = sequences - real, keys // PAGE_TOKENS - pages

    def rows(tensor, fill):  # pad dimension 0 with `fill`
        return torch.cat([tensor, torch.full((extra, *tensor.shape[1:]), fill, dtype=tensor.dtype)])

    def columns(tensor, fill, count):  # pad dimension 1 with `count` times `fill`
        return torch.cat([tensor, torch.full((tensor.shape[0], count), fill, dtype=tensor.dtype)], dim=1)

    padding_tokens = torch.arange(real, sequences)
    key_valid = rows(columns(group.key_valid, False, extra_pages * PAGE_TOKENS), False)
    key_valid[real:, 0] = True  # a padding sequence sees one (zero) key: its softmax stays finite
    return RoundTensors(
        positions=rows(token_positions(segments, "cpu"), 0),
        query_tokens=torch.cat([group.query_tokens, padding_tokens[:, None]]),
        key_index=rows(columns(group.key_index, pool.zero_page, extra_pages), pool.zero_page),
        query_positions=rows(group.query_positions, 0),
        key_positions=torch.arange(keys),
        key_valid=key_valid,
        destination=torch.cat([group.destination, padding_tokens]),
        write_slots=rows(group.write_slots, pool.scratch_slot),
    )


class CapturedRound:
    """One bucket's round: static input tensors, and the span's forward over them, captured as a CUDA graph
    (or, with capture=False, run eagerly over the same tensors)."""

    def __init__(self, template: RoundTensors, hidden_size: int, dtype, forward: Callable, device, capture: bool,
                 memory_pool=None):
        self.inputs = RoundTensors(**{field.name: getattr(template, field.name).to(device)
                                      for field in fields(template)})
        # padding rows keep whatever finite values an earlier round left: their outputs are dropped
        self.hidden = torch.zeros(1, template.positions.shape[0], hidden_size, dtype=dtype, device=device)
        self.forward, self.graph = lambda: forward(self.hidden, self.inputs), None
        if capture:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm-up runs: lazy initializations must not happen while capturing
                for _ in range(2):
                    self.forward()
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=memory_pool):
                self.output = self.forward()  # lives in the graph's memory: each replay overwrites it

    def replay(self, hidden: torch.Tensor, inputs: RoundTensors) -> torch.Tensor:
        """The padded round's outputs (1, bucket, hidden); the first hidden.shape[1] are the real ones."""
        self.hidden[:, : hidden.shape[1]].copy_(hidden)
        self.inputs.copy_from(inputs)
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        return self.output


class DecodeGraphs:
    """A span's captured decode rounds, one per (block range, sequences, keys) bucket, made on first use.

    `forward_batch(hidden, batch, start, end)` is the span's forward of a built PackedBatch through blocks
    [start, end); `first_block` is the span's first block (the pool's layer 0)."""

    def __init__(self, pool: Optional[KVPool], first_block: int, forward_batch: Callable, dtype: torch.dtype,
                 device: torch.device, capture: bool):
        self.pool, self.first_block, self.forward_batch = pool, first_block, forward_batch
        self.dtype, self.device, self.capture = dtype, device, capture
        self.rounds: dict[tuple, CapturedRound] = {}
        self.memory_pool = torch.cuda.graph_pool_handle() if capture else None  # shared by every graph
        self.failed = False  # a round could not be captured: every round runs eagerly

    def replay(self, hidden: torch.Tensor, segments: list[Segment], start: int, end: int) -> Optional[torch.Tensor]:
        """The round's outputs (1, tokens, hidden) from its bucket's graph (captured on the bucket's first round),
        or None when it must run eagerly."""
        if self.failed or not all(segment.cache is not None and segment.length == 1 for segment in segments):
            return None
        sequences = sum(segment.rows for segment in segments)
        keys = max(segment.position + 1 for segment in segments)
        size, width = bucket(sequences, SEQUENCE_BUCKETS), key_bucket(keys)
        if size is None or width is None:
            return None
        inputs = padded_round(segments, self.pool, size, width)
        key = (start, end, size, width)
        if key not in self.rounds:
            try:
                self.rounds[key] = CapturedRound(inputs, hidden.shape[-1], self.dtype, self._forward(start, end),
                                                 self.device, self.capture, self.memory_pool)
            except Exception:  # a layer that cannot be captured (a host sync in it): eager from now on
                logger.warning("could not capture a decode round as a CUDA graph; running rounds eagerly",
                               exc_info=True)
                self.failed = True
                return None
        return self.rounds[key].replay(hidden, inputs)[:, :sequences]

    def _forward(self, start: int, end: int) -> Callable[[torch.Tensor, RoundTensors], torch.Tensor]:
        def forward(hidden: torch.Tensor, inputs: RoundTensors) -> torch.Tensor:
            return self.forward_batch(hidden, inputs.batch(self.pool, start - self.first_block), start, end)

        return forward
