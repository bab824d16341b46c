"""What a registry entry is: a Family (the server's side: the layers) and its ClientSide (embeddings, final norm,
LM head). Every field is data or a function; a family's quirks are the functions it picks, never ifs on names."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Optional

from torch import nn


def rms_norm(family: "Family", config) -> nn.Module:
    """The family's own RMSNorm class (Gemma's scales by 1 + weight: its class knows)."""
    return getattr(family.modeling(), family.prefix + "RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)


def layer_norm(family: "Family", config) -> nn.Module:
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


def unscaled(config) -> Optional[float]:
    return None


def hidden_size_root(config) -> Optional[float]:
    """Gemma multiplies the token embeddings by sqrt(hidden_size)."""
    return config.hidden_size**0.5


def uncapped(config) -> Optional[float]:
    return None


def final_logit_softcap(config) -> Optional[float]:
    """Gemma's cap on the logits (tanh(logits / cap) * cap), where the config sets one."""
    return getattr(config, "final_logit_softcapping", None)


def no_window(config, layer_index: int) -> Optional[int]:
    return None


def window_by_layer_type(config, layer_index: int) -> Optional[int]:
    """The layers config.layer_types names sliding_attention get config.sliding_window (Qwen2, Qwen3, Gemma);
    without layer_types, every layer gets it (Mistral, Phi-3, Qwen3-MoE), None meaning full attention."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return config.sliding_window if layer_types[layer_index] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)


def config_as_is(config):
    return config


def state_as_is(state: dict) -> dict:
    return state


def always_supported(config) -> Optional[str]:
    return None


@dataclass(frozen=True)
class ClientSide:
    """What the client holds of a model, by checkpoint key: it reads these and never a block's tensors."""

    embed_key: str  # token embeddings
    norm_prefix: str  # the final norm: <prefix>weight (and <prefix>bias for a LayerNorm)
    norm: Callable  # (family, config) -> an empty norm module, of the final norm's class (and the embedding norm's)
    lm_head_key: str = "lm_head.weight"  # tied to embed_key when absent or when config.tie_word_embeddings
    position_embed_key: Optional[str] = None  # learned absolute positions, added to the token embeddings (GPT-2)
    embed_norm_prefix: Optional[str] = None  # a norm right after the embeddings (BLOOM's word_embeddings_layernorm)
    embed_scale: Callable = unscaled  # (config) -> a factor of the token embeddings, or None
    logit_softcap: Callable = uncapped  # (config) -> the cap of the final logits, or None

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
    sliding_window: Callable = no_window  # (config, layer_index) -> int | None
    layer_config: Callable = config_as_is  # (config) -> the config its layers are built from
    layer_state: Callable = state_as_is  # (a block's checkpoint tensors, named within it) -> its module's state dict
    unsupported: Callable = always_supported  # (config) -> why this checkpoint of the family cannot be served

    def modeling(self):
        """transformers' modeling module of the family, imported only when needed."""
        return importlib.import_module(f"transformers.models.{self.module}.modeling_{self.module}")

    def new_layer(self, config, index: int) -> nn.Module:
        return getattr(self.modeling(), self.layer_class)(self.layer_config(config), index)
