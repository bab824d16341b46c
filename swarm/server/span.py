"""A span of decoder layers, run over packed batches of sessions: the block server's compute.

A forward runs a packed batch: the new tokens of several sessions (decode steps, prefill chunks) side by side
in one sequence, so that each weight is read once for all of them, and attention runs per group of sequences
over the span's page pool (swarm/server/attention.py). The layers' parameters stay in transformers' own
modules (projections, MLP, norms: stable for years); the attention itself is ours, so that the cache is
written in place and attention goes through torch's scaled_dot_product_attention. How each family's layer
runs is swarm/families/'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from swarm.families import Family, family_of
from swarm.protocol import BadRequestError, ServerUnavailableError
from swarm.server import metrics
from swarm.server.adapters import applied
from swarm.server.attention import PackedBatch, Segment
from swarm.server.cache import KVPool, SessionCache
from swarm.server.graphs import DecodeGraphs, capture_disabled
from swarm.server.quantize import quantize_linears
from swarm.weights import load_config, load_tensors

DEFAULT_POOL_TOKENS = 16384  # a span's pool when no backend sized it (tests, the throughput measurement)


@dataclass(frozen=True)
class GraphsCaptured:
    """What capturing a span's rounds ahead took: the server's start-up line says it."""

    rounds: int
    seconds: float
    memory_bytes: int  # device memory the graphs hold (their shared pool and static tensors)


def _device_memory(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


class BlockSpan(nn.Module):
    """Blocks [start, end) of a model, computed over the new positions of sessions (or cache-less sequences)."""

    def __init__(self, config, start: int, end: int, layers: list, family: Family, loaded_names: list[str],
                 dtype: torch.dtype = torch.float32, quantization: Optional[str] = None):
        super().__init__()
        self.config, self.start, self.end, self.family = config, start, end, family
        self._device: Optional[torch.device] = None  # of its layers, which load_span placed before
        self.dtype = dtype  # of the hidden states and the cache (quantized weights are stored in fewer bits)
        self.quantization = quantization
        self.layers = nn.ModuleList(layers)
        self.position_state = family.position_state(family, config, self.device)  # rotary, ALiBi slopes, or None
        self.loaded_names = loaded_names  # every checkpoint tensor this span read: proof it read no others
        self.kv_heads, self.head_dim = family.cache_shape(config, layers[0])
        self.pool: Optional[KVPool] = None  # every session's keys and values (see new_pool)
        self.graphs: Optional[DecodeGraphs] = None  # captured decode rounds (see use_graphs)
        self.adapters: frozenset[str] = frozenset()  # LoRA adapters its layers apply on request (adapters.py)

    @property
    def device(self) -> torch.device:
        if self._device is None:  # once: walking a module's parameters costs more than a round's packing
            self._device = next(self.layers[0].parameters()).device
        return self._device

    def weight_bytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in [*self.parameters(), *self.buffers()])

    def new_pool(self, tokens: int) -> KVPool:
        """The page pool of this span's sessions, for `tokens` slots of every layer (the server's budget)."""
        self.pool = KVPool(len(self.layers), self.kv_heads, self.head_dim, tokens, self.dtype, self.device)
        if self.graphs is not None:
            self.use_graphs(self.graphs.capture)  # captured rounds hold the old pool's addresses
        return self.pool

    def use_graphs(self, capture: bool = True) -> None:
        """Run decode rounds through DecodeGraphs: captured CUDA graphs (capture=True, on a CUDA device), or the
        same padded rounds run eagerly (capture=False: how a CPU checks that path). Not after a capture failed
        in this process: rounds stay eager."""
        self.graphs = None if capture and capture_disabled() else self.new_graphs(capture)

    def new_graphs(self, capture: bool) -> DecodeGraphs:
        """Decode rounds over this span's pool (see use_graphs); new_pool makes new ones for a new pool."""
        return DecodeGraphs(self.pool, (self.start, self.end), self.forward_batch, self.dtype, self.device, capture)

    def capture_graphs_ahead(self, max_tokens: int, max_keys: int) -> Optional[GraphsCaptured]:
        """Every steady round of the span's whole range (up to `max_tokens` padded tokens and `max_keys` keys),
        captured now, before the server takes requests, not on the first rounds' path; what it took. None
        without graphs or a pool."""
        if self.graphs is None or self.pool is None:
            return None
        began, memory = time.perf_counter(), _device_memory(self.device)
        rounds = self.graphs.capture_ahead(self.config.hidden_size, max_tokens, min(max_keys, self.max_positions))
        return GraphsCaptured(rounds, time.perf_counter() - began, _device_memory(self.device) - memory)

    @property
    def max_positions(self) -> int:
        return getattr(self.config, "max_position_embeddings", None) or 1 << 20

    def new_cache(self, rows: int, capacity: int = 0) -> SessionCache:
        """A session's cache of `rows` sequences in the pool, with pages for `capacity` positions (it takes
        more as it grows: see SessionCache)."""
        if self.pool is None:
            self.new_pool(DEFAULT_POOL_TOKENS)
        cache = SessionCache(self.pool, rows)
        cache.prepare(0, capacity)
        return cache

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,  # (rows, new positions, hidden)
        position: int = 0,
        cache: Optional[SessionCache] = None,
        start: Optional[int] = None,
        end: Optional[int] = None,
        adapter: Optional[str] = None,
    ) -> torch.Tensor:
        """One request's new positions through blocks [start, end) (default: the whole span), on the caller's
        thread, which owns `cache`: it takes the pages the request needs (the server's compute thread never
        does; see forward_packed)."""
        if cache is not None:
            cache.prepare(position, position + hidden.shape[1])
        segment = Segment(hidden.shape[0], hidden.shape[1], position, cache, adapter)
        return self.forward_packed(hidden.reshape(1, -1, hidden.shape[-1]), [segment], start, end).view(hidden.shape)

    @torch.inference_mode()
    def forward_packed(
        self, hidden: torch.Tensor, segments: list[Segment], start: Optional[int] = None, end: Optional[int] = None
    ) -> torch.Tensor:
        """Several requests at once: their new tokens packed as (1, tokens, hidden), segment after segment
        (see PackedBatch); returns the outputs packed the same way. Every cache must hold, in this span's pool,
        the pages of the positions it is given: this takes none (it runs on the compute thread)."""
        start = self.start if start is None else start
        end = self.end if end is None else end
        if not self.start <= start < end <= self.end:
            raise BadRequestError(f"blocks {start}:{end} are outside this server's span {self.start}:{self.end}")
        self.check_caches(segments)
        hidden = self.on_device(hidden)
        if self.graphs is not None:
            output = self.graphs.replay(hidden, segments, start, end)
            if output is not None:
                return output
            if self.graphs.failed:  # a layer that cannot be captured: eager from now on
                self.graphs = None
        else:
            metrics.EAGER_ROUNDS.labels("no graphs").inc()
        return self.forward_batch(hidden, PackedBatch.of(segments, self.pool, start - self.start, self.device),
                                  start, end)

    def on_device(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states on the span's device, in its dtype (from the host, through pinned memory)."""
        return _to_device(hidden, self.device, self.dtype)

    def check_caches(self, segments: list[Segment]) -> None:
        """Refuse a round that would write through page numbers of another pool (the server moved to other
        blocks since the request began) or past a cache's pages (they would land in the shared zero page)."""
        for segment in segments:
            if segment.adapter is not None and segment.adapter not in self.adapters:
                raise BadRequestError(f"this server has no adapter {segment.adapter!r}")
            if segment.cache is None:
                continue
            if segment.cache.pool is not self.pool:
                raise ServerUnavailableError("this server moved to other blocks while the request ran; try again")
            if not segment.cache.covers(segment.position + segment.length):
                raise RuntimeError(f"a cache lacks the pages of positions up to {segment.position + segment.length}")

    def forward_batch(self, hidden: torch.Tensor, batch: PackedBatch, start: int, end: int) -> torch.Tensor:
        """A built batch's packed tokens (1, tokens, hidden), on the span's device, through blocks [start, end):
        the eager path's forward, and what decode graphs capture."""
        layers = list(self.layers)[start - self.start : end - self.start]  # slicing a ModuleList builds a module
        self.family.batch_inputs(self.position_state, hidden, batch)
        batch.build_masks({layer.attention_window for layer in layers}, self.dtype)
        with applied(batch.adapter_tokens, batch.positions):
            for index, layer in enumerate(layers):
                hidden = self.family.layer_forward(layer, hidden, batch, index)
        return hidden


def _to_device(hidden: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Hidden states on the span's device; from the host through pinned memory, so that the copy queues behind
    the device's work instead of stalling the thread (a pageable copy waits for it)."""
    if device.type != "cuda" or hidden.device.type == "cuda":
        return hidden.to(device, dtype)
    staged = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
    staged.copy_(hidden)
    return staged.to(device, dtype, non_blocking=True)


def load_span(folder: Path, start: int, end: int, device="cpu", dtype=torch.float32,
              reuse: Optional[BlockSpan] = None, quantization: Optional[str] = None) -> BlockSpan:
    """Build blocks [start, end) from a Hugging Face folder, reading only their weights; the layers of
    `reuse` (a span this server held) that fall in the new range are kept, not read again. `quantization`
    ("int8" or "nf4") stores the layers' linear weights in 8 or 4 bits (see quantize_linears)."""
    config = load_config(folder)
    family = family_of(config)
    num_blocks = config.num_hidden_layers
    if not 0 <= start < end <= num_blocks:
        raise BadRequestError(f"blocks {start}:{end} are out of range: this model has blocks 0:{num_blocks}")
    kept = {} if reuse is None else dict(zip(range(reuse.start, reuse.end), reuse.layers))
    prefixes = {index: family.layer_key.format(index) for index in range(start, end) if index not in kept}
    tensors = load_tensors(folder, lambda name: name.startswith(tuple(prefixes.values())))

    layers = []
    for index in range(start, end):
        if index in kept:
            layers.append(kept[index])
            continue
        prefix = prefixes[index]
        with torch.device("meta"):  # no throwaway random init: the checkpoint fills every parameter
            layer = family.new_layer(config, index)
        state = {name[len(prefix):]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}
        layer.load_state_dict(family.layer_state(state), strict=True, assign=True)
        layer.to(device=device, dtype=dtype)
        if quantization is not None:
            quantize_linears(layer, quantization, dtype)
            layer.to(device)  # bitsandbytes quantizes the weights as they move to the device
        layer.attention_window = family.sliding_window(config, index)
        layers.append(layer.eval().requires_grad_(False))  # served, never trained: no autograd state anywhere
    kept_prefixes = tuple(family.layer_key.format(index) for index in kept if start <= index < end)
    kept_names = [name for name in (reuse.loaded_names if reuse else []) if name.startswith(kept_prefixes)] \
        if kept_prefixes else []
    return BlockSpan(config, start, end, layers, family, loaded_names=sorted([*tensors, *kept_names]), dtype=dtype,
                     quantization=quantization)
