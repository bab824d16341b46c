"""Every quirk of every model family, in one registry (FAMILIES, keyed by transformers' config.model_type):
which transformers classes hold the parameters, where the weights sit in the checkpoint, how positions reach
the layers (rotary cos/sin, an ALiBi bias, or learned embeddings added at the client), how a layer runs over a
packed batch, and what the client holds (embeddings, final norm, LM head). Variants are entries of functions,
never ifs on names.

    family.py     Family and ClientSide: what an entry holds; norms, windows, embedding scale, logit caps
    positions.py  rotary (one cos/sin pair, or one per layer type), ALiBi, learned positions
    decoder.py    the rotary decoder layer, its parts: projections, QK-norm, partial rotary, soft-capping, residuals
    experts.py    mixtures of experts: their tensors stacked at load, their batched implementation
    classic.py    BLOOM's and GPT-2's layers

A layer forward gets the packed batch of the block server's round (PackedBatch, swarm/server/attention.py)
and calls its `attend` for the attention over the sessions' caches; the family adds what its positions need
once per forward (`batch_inputs`: rotary cos/sin, ALiBi slopes), and the masks follow from them. This package
imports nothing of the server nor of the client.
"""

from __future__ import annotations

from typing import Optional

from swarm.families.classic import bloom_cache_shape, bloom_layer_forward, gpt2_cache_shape, gpt2_layer_forward
from swarm.families.decoder import (RotaryDecoderLayer, attention_logit_softcap, fused_qkv, kv_cache_shape,
                                    qk_norm, rotate_head_fronts, sandwich_residuals)
from swarm.families.experts import grouped_experts, stacked_experts
from swarm.families.family import (ClientSide, Family, final_logit_softcap, hidden_size_root, layer_norm, no_window,
                                   rms_norm, window_by_layer_type)
from swarm.families.positions import (alibi_inputs, alibi_state, causal_inputs, no_position_state,
                                      rotary_by_layer_type_inputs, rotary_inputs, rotary_of_layer_type, rotary_state)
from swarm.protocol import UnknownModelError

__all__ = ["FAMILIES", "ClientSide", "Family", "family_of"]

LLAMA_STYLE_CLIENT = ClientSide(embed_key="model.embed_tokens.weight", norm_prefix="model.norm.", norm=rms_norm)
GEMMA_CLIENT = ClientSide(embed_key="model.embed_tokens.weight", norm_prefix="model.norm.", norm=rms_norm,
                          embed_scale=hidden_size_root, logit_softcap=final_logit_softcap)


def bidirectional_attention(config) -> Optional[str]:
    """EmbeddingGemma is a gemma3_text checkpoint whose layers see the whole sequence: not a causal LM."""
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention (an embedding model, not a causal LM) is not supported"
    return None


def rotary_family(module: str, prefix: str, layer: RotaryDecoderLayer = RotaryDecoderLayer(),
                  client: ClientSide = LLAMA_STYLE_CLIENT, **quirks) -> Family:
    """A family of rotary decoder layers under model.layers.N, with its own variant of the layer's parts."""
    return Family(
        module=module,
        prefix=prefix,
        layer_class=prefix + "DecoderLayer",
        layer_key="model.layers.{}.",
        layer_forward=layer,
        position_state=rotary_state,
        batch_inputs=quirks.pop("batch_inputs", rotary_inputs),
        cache_shape=kv_cache_shape,
        client=client,
        **quirks,
    )


QWEN3_LAYER = RotaryDecoderLayer(normalize_qk=qk_norm)
GEMMA2_LAYER = RotaryDecoderLayer(softcap=attention_logit_softcap, residuals=sandwich_residuals)
GEMMA3_LAYER = RotaryDecoderLayer(normalize_qk=qk_norm, rotary=rotary_of_layer_type, residuals=sandwich_residuals)
PHI3_LAYER = RotaryDecoderLayer(project=fused_qkv, rotate=rotate_head_fronts)

FAMILIES = {
    "llama": rotary_family("llama", "Llama", sliding_window=no_window),
    "mistral": rotary_family("mistral", "Mistral", sliding_window=window_by_layer_type),  # sliding-window attention
    "qwen2": rotary_family("qwen2", "Qwen2", sliding_window=window_by_layer_type),  # q/k/v biases: in the modules
    "qwen3": rotary_family("qwen3", "Qwen3", QWEN3_LAYER, sliding_window=window_by_layer_type),
    "qwen3_moe": rotary_family("qwen3_moe", "Qwen3Moe", QWEN3_LAYER, sliding_window=window_by_layer_type,
                               layer_config=grouped_experts, layer_state=stacked_experts),
    "phi3": rotary_family("phi3", "Phi3", PHI3_LAYER, sliding_window=window_by_layer_type),
    "gemma2": rotary_family("gemma2", "Gemma2", GEMMA2_LAYER, GEMMA_CLIENT, sliding_window=window_by_layer_type),
    "gemma3_text": rotary_family("gemma3", "Gemma3", GEMMA3_LAYER, GEMMA_CLIENT, sliding_window=window_by_layer_type,
                                 batch_inputs=rotary_by_layer_type_inputs, unsupported=bidirectional_attention),
    "bloom": Family(  # Petals Chat's original family
        module="bloom",
        prefix="Bloom",
        layer_class="BloomBlock",
        layer_key="transformer.h.{}.",
        layer_forward=bloom_layer_forward,
        position_state=alibi_state,
        batch_inputs=alibi_inputs,
        cache_shape=bloom_cache_shape,
        client=ClientSide(
            embed_key="transformer.word_embeddings.weight",
            embed_norm_prefix="transformer.word_embeddings_layernorm.",
            norm_prefix="transformer.ln_f.",
            norm=layer_norm,
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
        cache_shape=gpt2_cache_shape,
        client=ClientSide(
            embed_key="transformer.wte.weight",
            position_embed_key="transformer.wpe.weight",
            norm_prefix="transformer.ln_f.",
            norm=layer_norm,
        ),  # lm_head tied to wte
    ),
}


def family_of(config) -> Family:
    family = FAMILIES.get(config.model_type)
    if family is None:
        supported = ", ".join(FAMILIES)
        raise UnknownModelError(f"model type {config.model_type!r} is not supported (supported: {supported})")
    reason = family.unsupported(config)
    if reason is not None:
        raise UnknownModelError(f"this {config.model_type} checkpoint cannot be served: {reason}")
    return family
