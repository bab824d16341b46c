"""How many blocks a server holds when it is told neither --blocks nor --num-blocks: as many as its device's
memory fits, as Petals chooses (its server.py, _choose_num_blocks): the memory left after a round's working
memory, divided by what one block costs, its weights and its share of the attention cache (--cache-tokens slots
of every block). Which blocks it then holds is placement's choice, as for --num-blocks.

The memory is --memory-budget where given (a GPU shared with other work), else what the device has free now:
CUDA's free memory (this process's CUDA context already taken), or the RAM the OS says is available. A block's
weights are counted without reading any: its layer is built on the meta device, and its parameters are summed
in the bytes they take once loaded (the served dtype, or bitsandbytes' formats under --quantize).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from swarm.families import family_of
from swarm.protocol import PAGE_TOKENS, BadRequestError

GIB = 1 << 30
# bitsandbytes' bytes per weight of a quantized nn.Linear (swarm/server/quantize.py), its state included: int8
# keeps one float32 scale per output row besides (INT8_ROW_BYTES); nf4 packs two weights a byte, with a uint8
# absmax per block of 64 weights and a float32 absmax of those per 256 blocks (compressed statistics)
QUANTIZED_WEIGHT_BYTES = {"int8": 1.0, "nf4": 0.5 + 1 / 64 + 4 / (64 * 256)}
INT8_ROW_BYTES = 4


@dataclass(frozen=True)
class MemoryFit:
    """What the server's memory fits, in bytes: the ready line says it."""

    budget: int
    source: str  # where the budget comes from: --memory-budget, free GPU memory, available RAM
    weight_bytes: int  # of one block (the model's largest)
    cache_bytes: int  # one block's share of the cache pool
    working_bytes: int  # a round's activations and gathered keys, set aside first
    fits: int  # blocks that fit: may be more than the model has
    holds: int  # the blocks the server takes: fits, at most the model's

    def describe(self) -> str:
        return (f"holds {self.holds} blocks: {self.fits} fit its memory ({self.source}, {size_text(self.budget)}) "
                f"at {size_text(self.weight_bytes)} of weights + {size_text(self.cache_bytes)} of cache each, "
                f"after {size_text(self.working_bytes)} of working memory")


def fit_blocks(config, dtype: torch.dtype, quantization: Optional[str], cache_tokens: int, max_batch_tokens: int,
               budget: int, source: str, graphs: bool = False) -> MemoryFit:
    """How many of `config`'s blocks fit in `budget` bytes. `graphs`: decode rounds replay CUDA graphs, whose
    pool holds its own copy of a round's working memory. Refuses (BadRequestError) when not even one fits."""
    family = family_of(config)
    with torch.device("meta"):  # shapes only: nothing allocated, nothing initialised
        layers = [family.new_layer(config, index) for index in range(config.num_hidden_layers)]
    weights = max(block_weight_bytes(layer, dtype, quantization) for layer in layers)
    kv_heads, head_dim = family.cache_shape(config, layers[0])
    cache = cache_bytes_per_block(kv_heads, head_dim, cache_tokens, dtype)
    # per token of a round, a block's projections leave about one value per row of each of their matrices
    # (parameters / hidden size: q, k, v, o, gate, up, down); and a decode round gathers up to a block's cache
    parameters = max(sum(parameter.numel() for parameter in layer.parameters()) for layer in layers)
    activations = max_batch_tokens * math.ceil(parameters / config.hidden_size) * dtype.itemsize
    working = (activations + cache) * (2 if graphs else 1)
    fits = max((budget - working) // (weights + cache), 0)
    if fits < 1:
        raise BadRequestError(
            f"not even one block of this model fits in memory: one needs {weights + cache + working} bytes "
            f"({size_text(weights + cache + working)}: {weights} of weights, {cache} of cache for --cache-tokens "
            f"{cache_tokens}, {working} of working memory), and {budget} bytes are available ({source}, "
            f"{size_text(budget)}); lower --cache-tokens or add --quantize"
            + (", or raise --memory-budget" if source == "--memory-budget" else ""))
    return MemoryFit(budget, source, weights, cache, working, fits, min(fits, config.num_hidden_layers))


def block_weight_bytes(layer: nn.Module, dtype: torch.dtype, quantization: Optional[str] = None) -> int:
    """The bytes a block built as `layer` takes once loaded as load_span loads it: floating-point tensors in
    `dtype`, and under `quantization` the weights of its nn.Linear projections in bitsandbytes' format."""
    total = 0.0
    quantized = set()
    if quantization is not None:
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                quantized.add(id(module.weight))
                total += module.weight.numel() * QUANTIZED_WEIGHT_BYTES[quantization]
                total += module.out_features * INT8_ROW_BYTES if quantization == "int8" else 0
    for tensor in [*layer.parameters(), *layer.buffers()]:
        if id(tensor) not in quantized:
            total += tensor.numel() * (dtype.itemsize if tensor.is_floating_point() else tensor.element_size())
    return math.ceil(total)


def cache_bytes_per_block(kv_heads: int, head_dim: int, cache_tokens: int, dtype: torch.dtype) -> int:
    """One block's keys and values in the page pool of `cache_tokens` slots, as KVPool allocates them (its
    pages, plus the zero page and the scratch page)."""
    pages = max(cache_tokens // PAGE_TOKENS, 1) + 2
    return 2 * pages * PAGE_TOKENS * kv_heads * head_dim * dtype.itemsize


def memory_budget(device: torch.device, budget_gib: Optional[float]) -> tuple[int, str]:
    """The bytes a server may fill on `device`, and where that figure comes from."""
    if budget_gib is not None:
        return int(budget_gib * GIB), "--memory-budget"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)  # after this process's CUDA context, which this call creates
        return free, "free GPU memory"
    import psutil

    return psutil.virtual_memory().available, "available RAM"


def size_text(size: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size:.0f} bytes"
