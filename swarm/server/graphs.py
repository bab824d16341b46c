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

Captures are bounded: the span's whole range, every bucket (its short rounds captured ahead, before the
server takes requests: capture_ahead), plus the graphs of a few other block ranges a client asks for, least
recently used evicted, and only so many such captures in the span's life: a client walking sub-ranges cannot
make the server capture on and on (each capture syncs the device). Past that, rounds run eagerly.

DecodeGraphs gets from its span (swarm/server/span.py) what a round needs: the pool, the span's blocks, and
its forward over a built batch; this module never imports the span. When a capture fails, the compute thread
is put back on its own stream (torch's graph context skips that when ending the capture raises, and later
rounds would race the event loop's zeroing of fresh pages), the graphs say so (`failed`), and graphs are off
for the rest of the process: the span runs eagerly from then on.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch

from swarm.protocol import PAGE_TOKENS
from swarm.server.attention import Group, PackedBatch, Segment, group_sequences, token_positions
from swarm.server.cache import KVPool

logger = logging.getLogger(__name__)

SEQUENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_KEYS, MAX_KEYS = 64, 16384
OTHER_RANGES = 2  # block ranges besides the span's whole one that keep their graphs (least recently used go)
OTHER_RANGE_CAPTURES = 16  # captures of such ranges in a span's life; past them, their rounds run eagerly

_capture_failed = False  # a capture failed in this process: no graph is captured again


def capture_disabled() -> bool:
    return _capture_failed


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


def padding_round(pool, sequences: int, keys: int) -> RoundTensors:
    """A decode round of `sequences` padding sequences only: each reads the pool's zero page, sees its first
    key alone (its softmax stays finite) and writes to the scratch page. What a round is captured from ahead."""
    key_valid = torch.zeros(sequences, keys, dtype=torch.bool)
    key_valid[:, 0] = True
    tokens = torch.arange(sequences)
    return RoundTensors(
        positions=torch.zeros(sequences, dtype=torch.long),
        query_tokens=tokens[:, None].clone(),
        key_index=torch.full((sequences, keys // PAGE_TOKENS), pool.zero_page, dtype=torch.long),
        query_positions=torch.zeros(sequences, 1, dtype=torch.long),
        key_positions=torch.arange(keys),
        key_valid=key_valid,
        destination=tokens.clone(),
        write_slots=torch.full((sequences,), pool.scratch_slot, dtype=torch.long),
    )


def padded_round(segments: list[Segment], pool, sequences: int, keys: int) -> RoundTensors:
    """A decode round's inputs on the CPU, padded to `sequences` sequences and `keys` keys: its sequences
    first (sequence i is packed token i), padding sequences after them."""
    group = group_sequences(segments, pool, "cpu")[0]
    real, pages = group.key_index.shape
    padded = padding_round(pool, sequences, keys)
    padded.positions[:real] = token_positions(segments, "cpu")
    padded.key_index[:real, :pages] = group.key_index
    padded.query_positions[:real] = group.query_positions
    padded.key_valid[:real] = False
    padded.key_valid[:real, : group.key_valid.shape[1]] = group.key_valid
    padded.write_slots[:real] = group.write_slots
    return padded


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
            self.graph, self.output = _captured(self.forward, device, memory_pool)

    def replay(self, hidden: torch.Tensor, inputs: RoundTensors) -> torch.Tensor:
        """The padded round's outputs (1, bucket, hidden); the first hidden.shape[1] are the real ones."""
        self.hidden[:, : hidden.shape[1]].copy_(hidden)
        self.inputs.copy_from(inputs)
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        return self.output


def _captured(forward: Callable[[], torch.Tensor], device, memory_pool):
    """`forward` captured as a CUDA graph, and its output (in the graph's memory: each replay overwrites it).
    Not torch.cuda.graph: when ending a capture raises, its exit leaves the thread on the capture stream;
    here the stream comes back whatever happens, and a started capture is always ended."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up runs: lazy initializations must not happen while capturing
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):  # restores the thread's stream on the way out, even from a failure
        graph.capture_begin(memory_pool)
        try:
            output = forward()
        finally:
            graph.capture_end()  # a failure here follows the forward's own, if any
    return graph, output


class DecodeGraphs:
    """A span's captured decode rounds, one per (block range, sequences, keys) bucket: for the span's whole
    range, every bucket; for other ranges, those of the OTHER_RANGES most recently used, and at most
    OTHER_RANGE_CAPTURES captures of them in the span's life.

    `forward_batch(hidden, batch, start, end)` is the span's forward of a built PackedBatch through blocks
    [start, end); the span holds blocks `blocks` (start, end): its whole range (the pool's layer 0 is its
    first block)."""

    def __init__(self, pool: Optional[KVPool], blocks: tuple[int, int], forward_batch: Callable, dtype: torch.dtype,
                 device: torch.device, capture: bool):
        self.pool, self.forward_batch = pool, forward_batch
        self.first_block, self.whole_range = blocks[0], blocks
        self.dtype, self.device, self.capture = dtype, device, capture
        self.rounds: dict[tuple, CapturedRound] = {}  # (start, end, sequences, keys) -> its round
        self.other_ranges: OrderedDict[tuple[int, int], None] = OrderedDict()  # least recently used first
        self.other_captures = 0
        self.memory_pool = torch.cuda.graph_pool_handle() if capture else None  # shared by every graph
        self.failed = capture and capture_disabled()  # a capture failed: every round runs eagerly

    def capture_ahead(self, hidden_size: int) -> None:
        """The whole range's rounds of up to MIN_KEYS keys, every bucket of sequences: what sessions need most,
        captured before the server takes requests rather than on their path."""
        start, end = self.whole_range
        for size in SEQUENCE_BUCKETS:
            key = (start, end, size, MIN_KEYS)
            if self.failed or key in self.rounds:
                continue
            self._capture(key, padding_round(self.pool, size, MIN_KEYS), hidden_size)

    def replay(self, hidden: torch.Tensor, segments: list[Segment], start: int, end: int) -> Optional[torch.Tensor]:
        """The round's outputs (1, tokens, hidden) from its bucket's graph (captured on the bucket's first round,
        within the bounds), or None when it must run eagerly."""
        if self.failed or not all(segment.cache is not None and segment.length == 1 and segment.adapter is None
                                  for segment in segments):  # a LoRA adapter's gathers depend on the round
            return None
        sequences = sum(segment.rows for segment in segments)
        keys = max(segment.position + 1 for segment in segments)
        size, width = bucket(sequences, SEQUENCE_BUCKETS), key_bucket(keys)
        if size is None or width is None or not self._may_hold(start, end):
            return None
        inputs = padded_round(segments, self.pool, size, width)
        key = (start, end, size, width)
        if key not in self.rounds:
            if (start, end) != self.whole_range:
                if self.other_captures >= OTHER_RANGE_CAPTURES:
                    return None
                self.other_captures += 1
            if not self._capture(key, inputs, hidden.shape[-1]):
                return None
        return self.rounds[key].replay(hidden, inputs)[:, :sequences]

    def _may_hold(self, start: int, end: int) -> bool:
        """Whether rounds of blocks [start, end) may have graphs; another range than the whole one becomes the
        most recently used, and the least recently used one past OTHER_RANGES loses its graphs."""
        if (start, end) == self.whole_range:
            return True
        if (start, end) not in self.other_ranges and self.other_captures >= OTHER_RANGE_CAPTURES:
            return False  # no capture left for it: keep the ranges that have graphs
        self.other_ranges[(start, end)] = None
        self.other_ranges.move_to_end((start, end))
        while len(self.other_ranges) > OTHER_RANGES:
            evicted, _ = self.other_ranges.popitem(last=False)
            for key in [key for key in self.rounds if key[:2] == evicted]:
                del self.rounds[key]
        return True

    def _capture(self, key: tuple, inputs: RoundTensors, hidden_size: int) -> bool:
        global _capture_failed
        start, end = key[:2]
        try:
            self.rounds[key] = CapturedRound(inputs, hidden_size, self.dtype, self._forward(start, end),
                                             self.device, self.capture, self.memory_pool)
            return True
        except Exception:  # a layer that cannot be captured (a host sync in it), out of memory: eager from now on
            logger.warning("could not capture a decode round as a CUDA graph; running rounds eagerly from now on",
                           exc_info=True)
            self.failed = True
            if self.capture:
                _capture_failed = True
            return False

    def _forward(self, start: int, end: int) -> Callable[[torch.Tensor, RoundTensors], torch.Tensor]:
        def forward(hidden: torch.Tensor, inputs: RoundTensors) -> torch.Tensor:
            return self.forward_batch(hidden, inputs.batch(self.pool, start - self.first_block), start, end)

        return forward
