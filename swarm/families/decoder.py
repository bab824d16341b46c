"""The rotary decoder layer most families share (Llama, Mistral, Qwen2/3, Qwen3-MoE, Phi-3, Gemma 2/3), with
what varies between them as parts: how q/k/v come out of the layer (separate or fused projections, a per-head
RMSNorm of q and k), which rotary cos/sin a layer takes, how much of a head rotates, whether its attention
logits are soft-capped, and how the residual stream runs around attention and MLP (pre-norm, or Gemma's
norms before and after each).

A layer's parameters stay in transformers' own modules (projections, MLPs, norms, a mixture of experts): they
run over all the round's packed tokens at once, (1, tokens, hidden); the attention is the packed batch's.
"""

from __future__ import annotations

# PackedBatch appears in annotations only (see positions.py)

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from swarm.families.positions import one_rotary


def heads(projected: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(1, tokens, heads * head_dim) -> (1, tokens, heads, head_dim)."""
    return projected.unflatten(-1, (-1, head_dim))


# ------------------------------------------------------------------------------------------- projections


def separate_qkv(attention, normed: torch.Tensor):
    """q_proj, k_proj, v_proj -> (1, tokens, heads or kv heads, head_dim) each."""
    head_dim = attention.head_dim
    return (heads(attention.q_proj(normed), head_dim), heads(attention.k_proj(normed), head_dim),
            heads(attention.v_proj(normed), head_dim))


def fused_qkv(attention, normed: torch.Tensor):
    """Phi-3: one qkv_proj laid out [all q heads | all k heads | all v heads]."""
    head_dim, kv_width = attention.head_dim, attention.num_key_value_heads * attention.head_dim
    query_width = attention.qkv_proj.out_features - 2 * kv_width
    queries, keys, values = attention.qkv_proj(normed).split([query_width, kv_width, kv_width], dim=-1)
    return heads(queries, head_dim), heads(keys, head_dim), heads(values, head_dim)


def no_qk_norm(attention, queries: torch.Tensor, keys: torch.Tensor):
    return queries, keys


def qk_norm(attention, queries: torch.Tensor, keys: torch.Tensor):
    """Qwen3, Gemma 3: an RMSNorm over each head's dimensions of q and k, before rotary."""
    return attention.q_norm(queries), attention.k_norm(keys)


# ---------------------------------------------------------------------------------------------- rotary


def rotate_whole_heads(queries, keys, cos, sin):
    """transformers' apply_rotary_pos_emb (x * cos + rotate_half(x) * sin, cos and sin (1, tokens, head_dim)
    unsqueezed at dim 2), on the queries and the keys at once: the same elementwise arithmetic, hence the same
    bits, in 10 torch calls instead of 16 (on a round of a few rows, a layer's time is its calls)."""
    both = torch.cat((queries, keys), dim=2)  # (1, tokens, heads + kv heads, head_dim)
    half = both.shape[-1] // 2
    rotated = both * cos[:, :, None] + torch.cat((-both[..., half:], both[..., :half]), dim=-1) * sin[:, :, None]
    return rotated[:, :, : queries.shape[2]], rotated[:, :, queries.shape[2] :]


def rotate_head_fronts(queries, keys, cos, sin):
    """Partial rotary (Phi-3's partial_rotary_factor): the first cos.shape[-1] dimensions of a head rotate, the
    rest pass through; transformers' Phi-3 function does exactly that, and the whole head when cos covers it."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    return apply_rotary_pos_emb(queries, keys, cos, sin, unsqueeze_dim=2)


def no_softcap(attention) -> Optional[float]:
    return None


def attention_logit_softcap(attention) -> Optional[float]:
    """Gemma 2: tanh(scores / cap) * cap before the mask and softmax (Gemma 3's attention in transformers keeps the
    config field but never applies it, so Gemma 3 does not take this part)."""
    return attention.attn_logit_softcapping


# ------------------------------------------------------------------------------------------- residuals


def pre_norm_residuals(layer, hidden: torch.Tensor, attention_output: torch.Tensor) -> torch.Tensor:
    """hidden + attention, then + MLP of the post-attention norm. The MLP may be a mixture of experts (Qwen3-MoE):
    transformers' sparse block, called once on every token of the round (router, then the experts batched)."""
    hidden = hidden + attention_output
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def sandwich_residuals(layer, hidden: torch.Tensor, attention_output: torch.Tensor) -> torch.Tensor:
    """Gemma 2 and 3: a norm after attention, and norms before and after the MLP."""
    hidden = hidden + layer.post_attention_layernorm(attention_output)
    return hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))


@dataclass(frozen=True)
class RotaryDecoderLayer:
    """A layer forward (Family.layer_forward): input norm, q/k/v, rotary, the packed batch's attention over the
    sessions' caches, output projection, and the family's residual stream around it and the MLP."""

    project: Callable = separate_qkv  # (attention, normed) -> queries, keys, values (1, tokens, heads, head_dim)
    normalize_qk: Callable = no_qk_norm  # (attention, queries, keys) -> queries, keys
    rotary: Callable = one_rotary  # (attention, batch) -> the layer's (cos, sin)
    rotate: Callable = rotate_whole_heads  # (queries, keys, cos, sin) -> queries, keys
    softcap: Callable = no_softcap  # (attention) -> the cap of the attention logits, or None
    residuals: Callable = pre_norm_residuals  # (layer, hidden, attention output) -> the layer's output

    def __call__(self, layer, hidden: torch.Tensor, batch: PackedBatch, index: int) -> torch.Tensor:
        attention = layer.self_attn
        queries, keys, values = self.project(attention, layer.input_layernorm(hidden))
        queries, keys = self.normalize_qk(attention, queries, keys)
        queries, keys = self.rotate(queries, keys, *self.rotary(attention, batch))
        attended = batch.attend(index, queries, keys, values, layer.attention_window, attention.scaling,
                                softcap=self.softcap(attention))
        return self.residuals(layer, hidden, attention.o_proj(attended))


def kv_cache_shape(config, layer) -> tuple[int, int]:
    return config.num_key_value_heads, layer.self_attn.head_dim
