"""The two families of the pre-rotary era: BLOOM (ALiBi, a head-interleaved fused qkv, LayerNorms) and GPT-2
(learned positions added at the client, Conv1D projections). Their layers run over the packed batch as the
rotary ones do (decoder.py), with their own projections and residuals."""

from __future__ import annotations

# PackedBatch appears in annotations only (see positions.py)

import torch

from swarm.families.decoder import heads


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
    queries, keys, values = (heads(part, head_dim) for part in projected)

    attended = batch.attend(index, queries, keys, values, layer.attention_window, attention.scaling)
    hidden = hidden + attention.c_proj(attended)
    return hidden + layer.mlp(layer.ln_2(hidden))


def bloom_cache_shape(config, layer) -> tuple[int, int]:
    return layer.self_attention.num_heads, layer.self_attention.head_dim


def gpt2_cache_shape(config, layer) -> tuple[int, int]:
    return layer.attn.num_heads, layer.attn.head_dim
