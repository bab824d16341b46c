"""The fast path on CUDA: a span's steady rounds, captured once per shape bucket as CUDA graphs and replayed,
so that a round costs the GPU's time, not the CPU's time to issue hundreds of kernels.

A steady round is one of cached sessions' decode steps (one new position each) and verify steps (1 + a draft's
length of positions, see the gateway's speculation). It runs as one uniform group (swarm/server/attention.py):
n sequences of q query slots each, attending to at most k keys. Rounds are padded up to a bucket (n to a power
of two, q to 1 + a power of two of draft tokens, k to a power of two of at least 64), so a few graphs serve
every round:

    the round's indices (CPU) --padded, through pinned memory--> static tensors (GPU) --replay--> static output

Padding sequences read the pool's zero page, see only their first key (so their softmax stays finite) and
write to the pool's scratch page; padding query slots of a real sequence write to the scratch page too; their
outputs are dropped. Prefill chunks, cache-less forwards, adapters' rounds and rounds beyond the largest bucket
run eagerly, counted by reason in metrics.EAGER_ROUNDS. On a CPU the same padded path can run eagerly
(`capture=False`), which is how the tests check it gives the eager round's outputs.

Every bucket of the span's whole range is captured ahead (capture_ahead: before the server takes requests, so
that no capture, with its warm-ups and device-wide synchronisation, lands on a request's path), sharing one
memory pool; a few other block ranges a client asks for get theirs on demand, least recently used evicted, and
only so many such captures in the span's life: a client walking sub-ranges cannot make the server capture on
and on. Past that, their rounds run eagerly.

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
from swarm.server import metrics
from swarm.server.attention import Group, PackedBatch, Segment
from swarm.server.cache import KVPool, pages_for

logger = logging.getLogger(__name__)

SEQUENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# a decode step, and 1 + a draft of 2, 4, 8, 16 or 32 tokens being verified (config.MAX_SPECULATIVE_TOKENS)
QUERY_BUCKETS = (1, 3, 5, 9, 17, 33)
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


def round_shapes(max_tokens: int, max_keys: int) -> list[tuple[int, int, int]]:
    """Every (sequences, queries, keys) bucket of a round of at most `max_tokens` padded tokens and `max_keys`
    keys: what capture_ahead captures, smallest first."""
    widest = key_bucket(min(max_keys, MAX_KEYS)) or MAX_KEYS
    keys = [size for size in (MIN_KEYS << shift for shift in range(16)) if size <= widest]
    return [(sequences, queries, width) for width in keys for sequences in SEQUENCE_BUCKETS
            for queries in QUERY_BUCKETS if sequences * queries <= max(max_tokens, 1)]


@dataclass
class RoundTensors:
    """What a captured round reads besides the hidden states: positions and group indices, padded. Its n
    sequences have q query slots each (a decode step fills one, a verify step 1 + its draft's length): sequence
    i's are packed tokens i*q .. i*q + q - 1."""

    positions: torch.Tensor  # (n * q,)
    query_tokens: torch.Tensor  # (n, q)
    key_index: torch.Tensor  # (n, pages)
    query_positions: torch.Tensor  # (n, q)
    key_positions: torch.Tensor  # (keys,)
    key_valid: torch.Tensor  # (n, keys)
    destination: torch.Tensor  # (n * q,)
    write_slots: torch.Tensor  # (n * q,)

    def copy_from(self, other: "RoundTensors") -> None:
        for field in fields(self):
            getattr(self, field.name).copy_(getattr(other, field.name), non_blocking=True)

    def batch(self, pool, first_layer: int) -> PackedBatch:
        group = Group(True, self.query_tokens, self.key_index, self.query_positions, self.key_positions,
                      self.key_valid, None, self.destination, self.write_slots, uniform=True)
        return PackedBatch(self.positions, [group], pool, first_layer)


def padding_round(pool, sequences: int, queries: int, keys: int) -> RoundTensors:
    """A round of `sequences` padding sequences only: each reads the pool's zero page, sees its first key alone
    (its softmax stays finite) and writes to the scratch page. What a round is captured from ahead."""
    key_valid = torch.zeros(sequences, keys, dtype=torch.bool)
    key_valid[:, 0] = True
    tokens = torch.arange(sequences * queries)
    return RoundTensors(
        positions=torch.zeros(sequences * queries, dtype=torch.long),
        query_tokens=tokens.view(sequences, queries).clone(),
        key_index=torch.full((sequences, keys // PAGE_TOKENS), pool.zero_page, dtype=torch.long),
        query_positions=torch.zeros(sequences, queries, dtype=torch.long),
        key_positions=torch.arange(keys),
        key_valid=key_valid,
        destination=tokens.clone(),
        write_slots=torch.full((sequences * queries,), pool.scratch_slot, dtype=torch.long),
    )


def padded_round(segments: list[Segment], pool, sequences: int, queries: int, keys: int
                 ) -> tuple[RoundTensors, Optional[torch.Tensor]]:
    """A round's inputs on the CPU, padded to `sequences` sequences of `queries` query slots and `keys` keys
    (its sequences first, padding sequences after them), and the slot of each of its packed tokens (None when
    token i is slot i: a round of decode steps)."""
    padded = padding_round(pool, sequences, queries, keys)
    lengths = torch.tensor([segment.length for segment in segments for _ in range(segment.rows)])
    starts = torch.tensor([segment.position for segment in segments for _ in range(segment.rows)])
    tables = [segment.cache.tables[row][: pages_for(segment.position + segment.length)]
              for segment in segments for row in range(segment.rows)]
    real, offsets = len(tables), torch.arange(queries)
    valid = offsets[None, :] < lengths[:, None]  # (real, q): the slots its tokens fill
    query_positions = starts[:, None] + offsets
    key_index = pool.page_table(tables, keys // PAGE_TOKENS)
    written = key_index.gather(1, query_positions.clamp(max=keys - 1) // PAGE_TOKENS) * PAGE_TOKENS \
        + query_positions % PAGE_TOKENS  # (real, q): the slot each new token's keys/values go to
    padded.positions[: real * queries] = query_positions.flatten()
    padded.query_positions[:real] = query_positions
    padded.key_index[:real] = key_index
    padded.key_valid[:real] = padded.key_positions[None, :] < (starts + lengths)[:, None]
    padded.write_slots[: real * queries] = torch.where(valid, written, pool.scratch_slot).flatten()
    if queries == 1:
        return padded, None
    return padded, (torch.arange(real)[:, None] * queries + offsets)[valid]


class CapturedRound:
    """One bucket's round: static input tensors, and the span's forward over them, captured as a CUDA graph
    (or, with capture=False, run eagerly over the same tensors)."""

    def __init__(self, template: RoundTensors, hidden_size: int, dtype, forward: Callable, device, capture: bool,
                 memory_pool=None, stream=None):
        self.inputs = RoundTensors(**{field.name: getattr(template, field.name).to(device)
                                      for field in fields(template)})
        # the host side of the inputs' copies: pinned, so that they go to the device without a host stall; two,
        # used in turn, since the next round is staged while the one before may not have read its copy yet
        self.stagings = [RoundTensors(**{field.name: _staging(getattr(template, field.name), device)
                                         for field in fields(template)}) for _ in range(2)]
        self.staged: list = [None, None]  # each staging's event: recorded once its copy to the device is queued
        # padding rows keep whatever finite values an earlier round left: their outputs are dropped
        self.hidden = torch.zeros(1, template.positions.shape[0], hidden_size, dtype=dtype, device=device)
        self.forward, self.graph = lambda: forward(self.hidden, self.inputs), None
        if capture:
            self.graph, self.output = _captured(self.forward, device, memory_pool, stream)

    def replay(self, hidden: torch.Tensor, inputs: RoundTensors, slots: Optional[torch.Tensor]) -> torch.Tensor:
        """The round's outputs (1, tokens, hidden) for its packed tokens `hidden` (1, tokens, hidden), token i
        in slot `slots[i]` (None: slot i)."""
        tokens = hidden.shape[1]
        self._stage(inputs)
        if slots is None:
            self.hidden[:, :tokens].copy_(hidden)
        else:
            slots = _staging(slots, self.hidden.device).to(self.hidden.device, non_blocking=True)
            self.hidden.index_copy_(1, slots, hidden)
        if self.graph is None:
            output = self.forward()
        else:
            self.graph.replay()
            output = self.output
        return output[:, :tokens] if slots is None else output.index_select(1, slots)


    def _stage(self, inputs: RoundTensors) -> None:
        staging, staged = self.stagings[0], self.staged[0]
        if staged is not None:
            staged.synchronize()  # the device has read this staging since (a round ago): no wait in practice
        staging.copy_from(inputs)
        self.inputs.copy_from(staging)
        if self.hidden.device.type == "cuda":
            self.staged[0] = torch.cuda.Event()
            self.staged[0].record()
        self.stagings.reverse()
        self.staged.reverse()


def _staging(tensor: torch.Tensor, device) -> torch.Tensor:
    return tensor.pin_memory() if torch.device(device).type == "cuda" else tensor.clone()


def _captured(forward: Callable[[], torch.Tensor], device, memory_pool, side=None):
    """`forward` captured as a CUDA graph, and its output (in the graph's memory: each replay overwrites it).
    Not torch.cuda.graph: when ending a capture raises, its exit leaves the thread on the capture stream;
    here the stream comes back whatever happens, and a started capture is always ended."""
    side = side or torch.cuda.Stream(device)
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
        self.rounds: dict[tuple, CapturedRound] = {}  # (start, end, sequences, queries, keys) -> its round
        self.other_ranges: OrderedDict[tuple[int, int], None] = OrderedDict()  # least recently used first
        self.other_captures = 0
        self.memory_pool = torch.cuda.graph_pool_handle() if capture else None  # shared by every graph
        # and one side stream for every capture: each stream would keep cached blocks of its own
        self.capture_stream = torch.cuda.Stream(device) if capture else None
        self.failed = capture and capture_disabled()  # a capture failed: every round runs eagerly

    def capture_ahead(self, hidden_size: int, max_tokens: int, max_keys: int) -> int:
        """Every round of the whole range (round_shapes: rows and query slots up to `max_tokens` padded tokens,
        keys up to `max_keys`), captured before the server takes requests: none is captured on a request's
        path. Returns how many there are."""
        start, end = self.whole_range
        for sequences, queries, keys in round_shapes(max_tokens, max_keys):
            key = (start, end, sequences, queries, keys)
            if self.failed:
                break
            if key not in self.rounds:
                self._capture(key, padding_round(self.pool, sequences, queries, keys), hidden_size)
        return sum(1 for key in self.rounds if key[:2] == self.whole_range)

    def replay(self, hidden: torch.Tensor, segments: list[Segment], start: int, end: int) -> Optional[torch.Tensor]:
        """The round's outputs (1, tokens, hidden) from its bucket's graph, or None when it runs eagerly (the
        reason counted in metrics.EAGER_ROUNDS)."""
        reason = self._eager_reason(segments)
        if reason is None:
            sequences = sum(segment.rows for segment in segments)
            queries = bucket(max(segment.length for segment in segments), QUERY_BUCKETS)
            shape = (bucket(sequences, SEQUENCE_BUCKETS), queries,
                     key_bucket(max(segment.position + segment.length for segment in segments)))
            key = (start, end, *shape)
            if None in shape:
                reason = "size"
            elif not self._may_hold(start, end):
                reason = "other range"
            elif key not in self.rounds and not self._capture_on_demand(key, hidden.shape[-1]):
                reason = "other range" if not self.failed else "capture failed"
        if reason is not None:
            metrics.EAGER_ROUNDS.labels(reason).inc()
            return None
        inputs, slots = padded_round(segments, self.pool, *shape)
        metrics.GRAPH_ROUNDS.inc()
        return self.rounds[key].replay(hidden, inputs, slots)

    def _eager_reason(self, segments: list[Segment]) -> Optional[str]:
        if self.failed:
            return "capture failed"
        if any(segment.adapter is not None for segment in segments):  # a LoRA adapter's gathers depend on the round
            return "adapter"
        if any(segment.cache is None or segment.length > QUERY_BUCKETS[-1] for segment in segments):
            return "prefill"
        return None

    def _capture_on_demand(self, key: tuple, hidden_size: int) -> bool:
        """A round not captured ahead: another block range's (within its bounds), or, before capture_ahead ran,
        the whole range's."""
        if key[:2] != self.whole_range:
            if self.other_captures >= OTHER_RANGE_CAPTURES:
                return False
            self.other_captures += 1
        return self._capture(key, padding_round(self.pool, *key[2:]), hidden_size)

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
                                             self.device, self.capture, self.memory_pool, self.capture_stream)
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
