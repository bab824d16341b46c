"""Transformer blocks: load a span of decoder layers, and run it over new positions with an attention cache.

Every quirk of a model family lives in this module, in its entry of FAMILIES: which transformers classes
hold the parameters, where the weights sit in the checkpoint, and how a layer runs. The layer's parameters
stay in transformers' own modules (projections, MLP, norms: stable for years); the attention itself is ours,
so that the cache is written in place and attention goes through torch's scaled_dot_product_attention.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from swarm.protocol import BadRequestError, UnknownModelError
from swarm.weights import load_config, load_tensors


# ------------------------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    module: str  # transformers.models.<module>.modeling_<module>
    prefix: str  # class-name prefix in that module: LlamaDecoderLayer, LlamaRMSNorm, ...
    layer_forward: Callable  # (layer, hidden, shared: SharedInputs, cache: LayerCache | None) -> hidden
    sliding_window: Callable  # (config, layer_index) -> int | None
    layer_key: str = "model.layers.{}."
    embed_key: str = "model.embed_tokens.weight"
    norm_key: str = "model.norm.weight"
    lm_head_key: str = "lm_head.weight"

    def classes(self):
        """(decoder layer, rotary embedding, final norm) classes, imported only when a span is built."""
        modeling = importlib.import_module(f"transformers.models.{self.module}.modeling_{self.module}")
        return tuple(getattr(modeling, self.prefix + suffix) for suffix in ("DecoderLayer", "RotaryEmbedding", "RMSNorm"))


def _no_window(config, layer_index: int) -> Optional[int]:
    return None


def _window_by_layer_type(config, layer_index: int) -> Optional[int]:
    """Qwen2 and Mistral name their sliding-window layers in config.layer_types (Mistral: all, when set)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return config.sliding_window if layer_types[layer_index] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)


# ------------------------------------------------------------------------------------------- the cache


class LayerCache:
    """One layer's keys and values for one session, preallocated and written in place."""

    def __init__(self, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device):
        shape = (batch, kv_heads, capacity, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)

    def write(self, position: int, keys: torch.Tensor, values: torch.Tensor):
        """Store the new positions' keys/values; return views over everything cached so far."""
        end = position + keys.shape[2]
        self.keys[:, :, position:end] = keys
        self.values[:, :, position:end] = values
        return self.keys[:, :, :end], self.values[:, :, :end]


@dataclass
class SharedInputs:
    """Computed once per forward and passed to every layer, as transformers does."""

    position: int  # absolute position of the first new token
    length: int  # number of new tokens
    cos: torch.Tensor  # (1, length, head_dim)
    sin: torch.Tensor
    masks: dict  # sliding window (or None) -> boolean mask (length, position + length), or None if causal is enough


def _attention_mask(position: int, length: int, window: Optional[int], device) -> Optional[torch.Tensor]:
    if window is None and (length == 1 or position == 0):
        return None  # a single query sees everything; a fresh prompt is plainly causal
    queries = torch.arange(position, position + length, device=device)[:, None]
    keys = torch.arange(position + length, device=device)[None, :]
    mask = keys <= queries
    if window is not None:
        mask &= keys > queries - window
    return mask


def llama_layer_forward(layer, hidden: torch.Tensor, shared: SharedInputs, cache: Optional[LayerCache]):
    """Pre-norm decoder layer with rotary positions and grouped-query attention (Llama, Mistral, Qwen2)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attention = layer.self_attn
    batch, length, _ = hidden.shape  # (batch, new positions, hidden)
    head_dim = attention.head_dim

    normed = layer.input_layernorm(hidden)
    queries = attention.q_proj(normed).view(batch, length, -1, head_dim).transpose(1, 2)  # (b, heads, s, hd)
    keys = attention.k_proj(normed).view(batch, length, -1, head_dim).transpose(1, 2)  # (b, kv_heads, s, hd)
    values = attention.v_proj(normed).view(batch, length, -1, head_dim).transpose(1, 2)
    queries, keys = apply_rotary_pos_emb(queries, keys, shared.cos, shared.sin)
    if cache is not None:
        keys, values = cache.write(shared.position, keys, values)

    mask = shared.masks[layer.attention_window]
    attended = F.scaled_dot_product_attention(
        queries, keys, values,
        attn_mask=mask,
        is_causal=mask is None and length > 1,
        scale=attention.scaling,
        enable_gqa=True,
    )  # (b, heads, s, hd)
    hidden = hidden + attention.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


FAMILIES = {
    "llama": Family("llama", "Llama", llama_layer_forward, _no_window),
    "mistral": Family("mistral", "Mistral", llama_layer_forward, _window_by_layer_type),
    "qwen2": Family("qwen2", "Qwen2", llama_layer_forward, _window_by_layer_type),
}


def family_of(config) -> Family:
    family = FAMILIES.get(config.model_type)
    if family is None:
        supported = ", ".join(FAMILIES)
        raise UnknownModelError(f"model type {config.model_type!r} is not supported (supported: {supported})")
    return family


# ------------------------------------------------------------------------------------------- the span


class BlockSpan(nn.Module):
    """Blocks [start, end) of a model, run over the new positions of a session (or a whole sequence)."""

    def __init__(self, config, start: int, end: int, layers: list, family: Family, loaded_names: list[str]):
        super().__init__()
        self.config, self.start, self.end, self.family = config, start, end, family
        self.layers = nn.ModuleList(layers)
        _, rotary_class, _ = family.classes()
        first = layers[0].input_layernorm.weight
        self.rotary = rotary_class(config=config).to(first.device)
        self.loaded_names = loaded_names  # every checkpoint tensor this span read: proof it read no others
        self.kv_heads = config.num_key_value_heads
        self.head_dim = layers[0].self_attn.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].input_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].input_layernorm.weight.device

    def new_cache(self, start: int, end: int, batch: int, capacity: int) -> list[LayerCache]:
        return [
            LayerCache(batch, self.kv_heads, capacity, self.head_dim, self.dtype, self.device)
            for _ in range(start, end)
        ]

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,  # (batch, new positions, hidden)
        position: int = 0,
        caches: Optional[list[LayerCache]] = None,
        start: Optional[int] = None,
        end: Optional[int] = None,
    ) -> torch.Tensor:
        start = self.start if start is None else start
        end = self.end if end is None else end
        if not self.start <= start < end <= self.end:
            raise BadRequestError(f"blocks {start}:{end} are outside this server's span {self.start}:{self.end}")
        hidden = hidden.to(self.device, self.dtype)
        length = hidden.shape[1]
        position_ids = torch.arange(position, position + length, device=self.device)[None, :]
        cos, sin = self.rotary(hidden, position_ids)
        layers = self.layers[start - self.start : end - self.start]
        windows = {layer.attention_window for layer in layers}
        masks = {window: _attention_mask(position, length, window, self.device) for window in windows}
        shared = SharedInputs(position, length, cos, sin, masks)
        for offset, layer in enumerate(layers):
            cache = caches[offset] if caches is not None else None
            hidden = self.family.layer_forward(layer, hidden, shared, cache)
        return hidden


def load_span(folder: Path, start: int, end: int, device="cpu", dtype=torch.float32,
              reuse: Optional[BlockSpan] = None) -> BlockSpan:
    """Build blocks [start, end) from a Hugging Face folder, reading only their weights; the layers of
    `reuse` (a span this server held) that fall in the new range are kept, not read again."""
    config = load_config(folder)
    family = family_of(config)
    num_blocks = config.num_hidden_layers
    if not 0 <= start < end <= num_blocks:
        raise BadRequestError(f"blocks {start}:{end} are out of range: this model has blocks 0:{num_blocks}")
    kept = {} if reuse is None else dict(zip(range(reuse.start, reuse.end), reuse.layers))
    layer_class, _, _ = family.classes()
    prefixes = {index: family.layer_key.format(index) for index in range(start, end) if index not in kept}
    tensors = load_tensors(folder, lambda name: name.startswith(tuple(prefixes.values())))

    layers = []
    for index in range(start, end):
        if index in kept:
            layers.append(kept[index])
            continue
        prefix = prefixes[index]
        with torch.device("meta"):  # no throwaway random init: the checkpoint fills every parameter
            layer = layer_class(config, index)
        state = {name[len(prefix):]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}
        layer.load_state_dict(state, strict=True, assign=True)
        layer.to(device=device, dtype=dtype)
        layer.attention_window = family.sliding_window(config, index)
        layers.append(layer.eval())
    kept_prefixes = tuple(family.layer_key.format(index) for index in kept if start <= index < end)
    kept_names = [name for name in (reuse.loaded_names if reuse else []) if name.startswith(kept_prefixes)] \
        if kept_prefixes else []
    return BlockSpan(config, start, end, layers, family, loaded_names=sorted([*tensors, *kept_names]))
