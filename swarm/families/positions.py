"""How positions reach a family's layers: rotary cos/sin (one pair, or one per layer type), an ALiBi bias, or
nothing (learned embeddings added at the client). Each kind is a pair of functions: a state built once per span
(`position_state`) and what a forward adds to its packed batch once for all its layers (`batch_inputs`).
"""

from __future__ import annotations

# PackedBatch and Family appear in annotations only: with postponed evaluation they are never resolved, and
# this shared module imports nothing of the server

import torch


def rotary_state(family: Family, config, device):
    """Transformers' own rotary embedding of the family (it knows every rope_scaling variant, and partial
    rotary: Phi-3's cos/sin cover only the rotated part of a head)."""
    rotary_class = getattr(family.modeling(), family.prefix + "RotaryEmbedding")
    return rotary_class(config=config).to(device)


def rotary_inputs(rotary, hidden: torch.Tensor, batch: PackedBatch) -> None:
    """Rotary: cos/sin of every new token's absolute position, once for all the forward's layers."""
    batch.rotary[None] = rotary(hidden, batch.positions[None, :])


def rotary_by_layer_type_inputs(rotary, hidden: torch.Tensor, batch: PackedBatch) -> None:
    """Gemma 3: sliding and full layers rotate with bases of their own (rope_parameters per layer type); one
    cos/sin pair per type, as transformers' Gemma3TextModel computes them for each forward."""
    for layer_type in sorted(set(rotary.config.layer_types)):
        batch.rotary[layer_type] = rotary(hidden, batch.positions[None, :], layer_type)


def one_rotary(attention, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    return batch.rotary[None]


def rotary_of_layer_type(attention, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    return batch.rotary[attention.layer_type]


def alibi_state(family: Family, config, device) -> torch.Tensor:
    """ALiBi's per-head slopes (float32, as transformers computes them)."""
    return family.modeling()._get_alibi_slopes(config.num_attention_heads, torch.device(device))


def alibi_inputs(slopes: torch.Tensor, hidden: torch.Tensor, batch: PackedBatch) -> None:
    """ALiBi: the attention masks become a bias of slope * absolute key position (softmax is invariant to the
    per-query shift that the paper's relative form adds, so it holds with a cache)."""
    batch.alibi_slopes = slopes


def no_position_state(family: Family, config, device) -> None:
    return None


def causal_inputs(_state, hidden: torch.Tensor, batch: PackedBatch) -> None:
    """Positions already in the hidden states (learned embeddings added at the client): only causal masks."""
