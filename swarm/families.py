"""Every quirk of every model family, in one registry (FAMILIES): which transformers classes hold the
parameters, where the weights sit in the checkpoint, how positions reach the layers (rotary cos/sin, an
ALiBi bias, or learned embeddings added at the client), how a layer runs over a packed batch, and what the
client holds (embeddings, final norm, LM head). Variants are entries of functions, never ifs on names.

A layer forward gets the packed batch of the block server's round (PackedBatch, swarm/server/attention.py)
and calls its `attend` for the attention over the sessions' caches; the family adds what its positions need
once per forward (`batch_inputs`: rotary cos/sin, ALiBi slopes), and the masks follow from them.
"""

from __future__ import annotations

# PackedBatch (swarm/server/attention.py) appears in annotations only: with postponed evaluation they
# are never resolved, and this shared module imports nothing of the server

import importlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from swarm.protocol import UnknownModelError


# ------------------------------------------------------------------------------------------- positions


def rotary_state(family: "Family", config, device):
    """Transformers' own rotary embedding of the family (it knows every rope_scaling variant)."""
    rotary_class = getattr(family.modeling(), family.prefix + "RotaryEmbedding")
    return rotary_class(config=config).to(device)


def rotary_inputs(rotary, hidden: torch.Tensor, batch: PackedBatch) -> None:
    """Rotary: cos/sin of every new token's absolute position, once for all the forward's layers."""
    batch.cos, batch.sin = rotary(hidden, batch.positions[None, :])


def alibi_state(family: "Family", config, device) -> torch.Tensor:
    """ALiBi's per-head slopes (float32, as transformers computes them)."""
    return family.modeling()._get_alibi_slopes(config.num_attention_heads, torch.device(device))


def alibi_inputs(slopes: torch.Tensor, hidden: torch.Tensor, batch: PackedBatch) -> None:
    """ALiBi: the attention masks become a bias of slope * absolute key position (softmax is invariant to the
    per-query shift that the paper's relative form adds, so it holds with a cache)."""
    batch.alibi_slopes = slopes


def no_position_state(family: "Family", config, device) -> None:
    return None


def causal_inputs(_state, hidden: torch.Tensor, batch: PackedBatch) -> None:
    """Positions already in the hidden states (learned embeddings added at the client): only causal masks."""


def _heads(projected: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(1, tokens, heads * head_dim) -> (1, tokens, heads, head_dim)."""
    return projected.unflatten(-1, (-1, head_dim))


# -------------------------------------------------------------------------------------- layer forwards


def llama_layer_forward(layer, hidden: torch.Tensor, batch: PackedBatch, index: int) -> torch.Tensor:
    """Pre-norm decoder layer with rotary positions and grouped-query attention (Llama, Mistral, Qwen2)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attention = layer.self_attn
    head_dim = attention.head_dim

    normed = layer.input_layernorm(hidden)
    queries = _heads(attention.q_proj(normed), head_dim)  # (1, tokens, heads, head_dim)
    keys = _heads(attention.k_proj(normed), head_dim)  # (1, tokens, kv_heads, head_dim)
    values = _heads(attention.v_proj(normed), head_dim)
    queries, keys = apply_rotary_pos_emb(queries, keys, batch.cos, batch.sin, unsqueeze_dim=2)

    attended = batch.attend(index, queries, keys, values, layer.attention_window, attention.scaling)
    hidden = hidden + attention.o_proj(attended)
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def bloom_layer_forward(layer, hidden: torch.Tensor, batch: PackedBatch, index: int) -> torch.Tensor:
    """BLOOM: LayerNorms, a fused query_key_value laid out head by head (q, k, v of head 0, then of head 1, ...),
    ALiBi in the attention bias, and optionally the residual taken after the norm."""
    attention = layer.self_attention
    post_norm_residual = layer.apply_residual_connection_post_layernorm

    normed = layer.input_layernorm(hidden)
    residual = normed if post_norm_residual else hidden
    fused = attention.query_key_value(normed).unflatten(-1, (attention.num_heads, 3, attention.head_dim))
    queries, keys, values = (fused[..., part, :] for part in range(3))  # (1, tokens, heads, head_dim)

    attended = batch.attend(index, queries, keys, values, layer.attention_window, attention.inv_norm_factor)
    hidden = residual + attention.dense(attended)

    normed = layer.post_attention_layernorm(hidden)
    return layer.mlp(normed, normed if post_norm_residual else hidden)  # BloomMLP adds its residual itself


def gpt2_layer_forward(layer, hidden: torch.Tensor, batch: PackedBatch, index: int) -> torch.Tensor:
    """GPT-2: LayerNorms ln_1/ln_2, Conv1D projections (c_attn fused as [q | k | v]), no positions in the layer."""
    attention = layer.attn
    head_dim = attention.head_dim

    projected = attention.c_attn(layer.ln_1(hidden)).split(attention.split_size, dim=2)
    queries, keys, values = (_heads(part, head_dim) for part in projected)

    attended = batch.attend(index, queries, keys, values, layer.attention_window, attention.scaling)
    hidden = hidden + attention.c_proj(attended)
    return hidden + layer.mlp(layer.ln_2(hidden))


def _no_window(config, layer_index: int) -> Optional[int]:
    return None


def _window_by_layer_type(config, layer_index: int) -> Optional[int]:
    """Qwen2 and Mistral name their sliding-window layers in config.layer_types (Mistral: all, when set)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return config.sliding_window if layer_types[layer_index] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)


def _llama_cache_shape(config, layer) -> tuple[int, int]:
    return config.num_key_value_heads, layer.self_attn.head_dim


def _bloom_cache_shape(config, layer) -> tuple[int, int]:
    return layer.self_attention.num_heads, layer.self_attention.head_dim


def _gpt2_cache_shape(config, layer) -> tuple[int, int]:
    return layer.attn.num_heads, layer.attn.head_dim


# ------------------------------------------------------------------------------------------- families


def _rms_norm(family: "Family", config) -> nn.Module:
    return getattr(family.modeling(), family.prefix + "RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)


def _layer_norm(family: "Family", config) -> nn.Module:
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


@dataclass(frozen=True)
class ClientSide:
    """What the client holds of a model, by checkpoint key: it reads these and never a block's tensors."""

    embed_key: str  # token embeddings
    norm_prefix: str  # the final norm: <prefix>weight (and <prefix>bias for a LayerNorm)
    norm: Callable  # (family, config) -> an empty norm module, of the final norm's class (and the embedding norm's)
    lm_head_key: str = "lm_head.weight"  # tied to embed_key when absent or when config.tie_word_embeddings
    position_embed_key: Optional[str] = None  # learned absolute positions, added to the token embeddings (GPT-2)
    embed_norm_prefix: Optional[str] = None  # a norm right after the embeddings (BLOOM's word_embeddings_layernorm)

    def keys(self) -> set[str]:
        norm_keys = {prefix + suffix for prefix in (self.norm_prefix, self.embed_norm_prefix) if prefix
                     for suffix in ("weight", "bias")}
        return {self.embed_key, self.lm_head_key, *norm_keys} | ({self.position_embed_key} - {None})


@dataclass(frozen=True)
class Family:
    module: str  # transformers.models.<module>.modeling_<module>: the classes that hold the parameters
    prefix: str  # class-name prefix in that module (LlamaRotaryEmbedding, LlamaRMSNorm, ...)
    layer_class: str  # the decoder layer class in that module, built as layer_class(config, layer_index)
    layer_key: str  # checkpoint prefix of block i's tensors: layer_key.format(i)
    layer_forward: Callable  # (layer, hidden, batch: PackedBatch, index in the forward's range) -> hidden
    position_state: Callable  # (family, config, device) -> what batch_inputs needs, built once per span
    batch_inputs: Callable  # (state, hidden, batch: PackedBatch): positions for the masks and layers, per forward
    cache_shape: Callable  # (config, layer) -> (kv heads, head_dim) of the layer's cache
    client: ClientSide
    sliding_window: Callable = _no_window  # (config, layer_index) -> int | None

    def modeling(self):
        """transformers' modeling module of the family, imported only when needed."""
        return importlib.import_module(f"transformers.models.{self.module}.modeling_{self.module}")

    def new_layer(self, config, index: int) -> nn.Module:
        return getattr(self.modeling(), self.layer_class)(config, index)


def _llama_style(module: str, prefix: str, sliding_window: Callable) -> Family:
    return Family(
        module=module,
        prefix=prefix,
        layer_class=prefix + "DecoderLayer",
        layer_key="model.layers.{}.",
        layer_forward=llama_layer_forward,
        position_state=rotary_state,
        batch_inputs=rotary_inputs,
        cache_shape=_llama_cache_shape,
        client=ClientSide(embed_key="model.embed_tokens.weight", norm_prefix="model.norm.", norm=_rms_norm),
        sliding_window=sliding_window,
    )


FAMILIES = {
    "llama": _llama_style("llama", "Llama", _no_window),
    "mistral": _llama_style("mistral", "Mistral", _window_by_layer_type),  # sliding-window attention
    "qwen2": _llama_style("qwen2", "Qwen2", _window_by_layer_type),  # biases on q/k/v: inside the modules
    "bloom": Family(  # Petals Chat's original family
        module="bloom",
        prefix="Bloom",
        layer_class="BloomBlock",
        layer_key="transformer.h.{}.",
        layer_forward=bloom_layer_forward,
        position_state=alibi_state,
        batch_inputs=alibi_inputs,
        cache_shape=_bloom_cache_shape,
        client=ClientSide(
            embed_key="transformer.word_embeddings.weight",
            embed_norm_prefix="transformer.word_embeddings_layernorm.",
            norm_prefix="transformer.ln_f.",
            norm=_layer_norm,
        ),  # lm_head tied to the word embeddings
    ),
    "gpt2": Family(
        module="gpt2",
        prefix="GPT2",
        layer_class="GPT2Block",
        layer_key="transformer.h.{}.",
        layer_forward=gpt2_layer_forward,
        position_state=no_position_state,
        batch_inputs=causal_inputs,
        cache_shape=_gpt2_cache_shape,
        client=ClientSide(
            embed_key="transformer.wte.weight",
            position_embed_key="transformer.wpe.weight",
            norm_prefix="transformer.ln_f.",
            norm=_layer_norm,
        ),  # lm_head tied to wte
    ),
}


def family_of(config) -> Family:
    family = FAMILIES.get(config.model_type)
    if family is None:
        supported = ", ".join(FAMILIES)
        raise UnknownModelError(f"model type {config.model_type!r} is not supported (supported: {supported})")
    return family
