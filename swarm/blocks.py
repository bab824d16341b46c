"""Transformer blocks: load a span of decoder layers, and run it over new positions with an attention cache.

Every quirk of a model family lives in this module, in its entry of FAMILIES: which transformers classes
hold the parameters, where the weights sit in the checkpoint, how positions reach the layers (rotary
cos/sin, an ALiBi bias, or learned embeddings added at the client), how a layer runs, and what the client
holds (embeddings, final norm, LM head). The layer's parameters stay in transformers' own modules
(projections, MLP, norms: stable for years); the attention itself is ours, so that the cache is written in
place and attention goes through torch's scaled_dot_product_attention.

A forward runs a packed batch: the new tokens of several sessions (decode steps, prefill chunks) side by side
in one sequence, so that each weight is read once for all of them; only attention runs per session.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from swarm.cache import LayerCache, SessionCache
from swarm.protocol import BadRequestError, SessionLengthError, UnknownModelError
from swarm.weights import load_config, load_tensors


# ------------------------------------------------------------------------------------------- a batch


@dataclass
class Segment:
    """One request's part of a packed batch: `rows` sequences of `length` new tokens each, from absolute
    `position`. In the packed batch its tokens are consecutive, row after row."""

    rows: int
    length: int
    position: int
    cache: Optional[SessionCache]  # None: whole sequences, nothing kept
    # attention window (None: full) -> what scaled_dot_product_attention gets as attn_mask: None when is_causal
    # is enough, a boolean (length, position + length) mask, or an additive float bias (ALiBi, with the causal
    # mask folded in as -inf) of shape (1, heads, length, position + length). Filled by the family.
    masks: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.rows * self.length


@dataclass
class PackedBatch:
    """The new tokens of several requests side by side in one sequence, hidden states (1, tokens, hidden):
    projections and MLPs run once over all of them (one read of the weights), attention per segment.
    Built once per forward by the family's `batch_inputs` and passed to every layer."""

    segments: list[Segment]
    cos: Optional[torch.Tensor] = None  # rotary families only: (1, tokens, head_dim)
    sin: Optional[torch.Tensor] = None

    def attend(self, index: int, queries, keys, values, window: Optional[int], scale: float) -> torch.Tensor:
        """Packed (1, tokens, heads, head_dim) queries/keys/values of layer `index` of the forward's range ->
        (1, tokens, heads * head_dim): each segment's keys/values go to its cache, its queries see its own past."""
        outputs, offset = [], 0
        for segment in self.segments:
            rows, length = segment.rows, segment.length
            # (tokens, heads, head_dim) -> (rows, heads, length, head_dim), as views
            q, k, v = (t[0, offset : offset + segment.tokens].unflatten(0, (rows, length)).transpose(1, 2)
                       for t in (queries, keys, values))
            if segment.cache is not None:
                k, v = segment.cache[index].write(segment.position, k, v)
            attended = F.scaled_dot_product_attention(
                q, k, v,
                attn_mask=segment.masks[window],
                is_causal=segment.masks[window] is None and length > 1,
                scale=scale,
                enable_gqa=True,
            )
            outputs.append(attended.transpose(1, 2).reshape(segment.tokens, -1))
            offset += segment.tokens
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs))[None]


def _causal_mask(position: int, length: int, window: Optional[int], device) -> torch.Tensor:
    """Which keys (absolute positions 0..position+length) each new query may see: (length, position + length)."""
    queries = torch.arange(position, position + length, device=device)[:, None]
    keys = torch.arange(position + length, device=device)[None, :]
    mask = keys <= queries
    if window is not None:
        mask &= keys > queries - window
    return mask


def _attention_mask(position: int, length: int, window: Optional[int], device) -> Optional[torch.Tensor]:
    if window is None and (length == 1 or position == 0):
        return None  # a single query sees everything; a fresh prompt is plainly causal
    if window is not None and position + length <= window:
        return _attention_mask(position, length, None, device)  # the window reaches back to position 0
    return _causal_mask(position, length, window, device)


def _set_masks(batch: PackedBatch, windows: set, device) -> None:
    for segment in batch.segments:
        segment.masks = {window: _attention_mask(segment.position, segment.length, window, device)
                         for window in windows}


def rotary_state(family: "Family", config, device):
    """Transformers' own rotary embedding of the family (it knows every rope_scaling variant)."""
    rotary_class = getattr(family.modeling(), family.prefix + "RotaryEmbedding")
    return rotary_class(config=config).to(device)


def rotary_inputs(rotary, hidden: torch.Tensor, batch: PackedBatch, windows: set) -> None:
    device = hidden.device
    position_ids = torch.cat([
        torch.arange(segment.position, segment.position + segment.length, device=device).repeat(segment.rows)
        for segment in batch.segments
    ])[None, :]
    batch.cos, batch.sin = rotary(hidden, position_ids)
    _set_masks(batch, windows, device)


def alibi_state(family: "Family", config, device) -> torch.Tensor:
    """ALiBi's per-head slopes (float32, as transformers computes them)."""
    return family.modeling()._get_alibi_slopes(config.num_attention_heads, torch.device(device))


def alibi_inputs(slopes: torch.Tensor, hidden: torch.Tensor, batch: PackedBatch, windows: set) -> None:
    """ALiBi: a bias of slope * key position over the absolute key positions 0..position+length (softmax is
    invariant to the per-query shift that the paper's relative form adds), so it holds with a cache."""
    device = hidden.device
    for segment in batch.segments:
        position, length = segment.position, segment.length
        alibi = slopes[:, None, None] * torch.arange(position + length, device=device)  # (heads, 1, keys), float32
        alibi = alibi.to(hidden.dtype)  # transformers casts it before adding it to the scores
        segment.masks = {
            window: alibi.masked_fill(~_causal_mask(position, length, window, device), float("-inf"))[None]
            for window in windows
        }  # (1, heads, length, keys)


def no_position_state(family: "Family", config, device) -> None:
    return None


def causal_inputs(_state, hidden: torch.Tensor, batch: PackedBatch, windows: set) -> None:
    """Positions already in the hidden states (learned embeddings added at the client): only the masks."""
    _set_masks(batch, windows, hidden.device)


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
    batch_inputs: Callable  # (state, hidden, batch: PackedBatch, windows: set): positions and masks, per forward
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


# ------------------------------------------------------------------------------------------- the span


class BlockSpan(nn.Module):
    """Blocks [start, end) of a model, run over the new positions of a session (or a whole sequence)."""

    def __init__(self, config, start: int, end: int, layers: list, family: Family, loaded_names: list[str],
                 dtype: torch.dtype = torch.float32, quantization: Optional[str] = None):
        super().__init__()
        self.config, self.start, self.end, self.family = config, start, end, family
        self.dtype = dtype  # of the hidden states and the cache (quantized weights are stored in fewer bits)
        self.quantization = quantization
        self.layers = nn.ModuleList(layers)
        self.position_state = family.position_state(family, config, self.device)  # rotary, ALiBi slopes, or None
        self.loaded_names = loaded_names  # every checkpoint tensor this span read: proof it read no others
        self.kv_heads, self.head_dim = family.cache_shape(config, layers[0])

    @property
    def device(self) -> torch.device:
        return next(self.layers[0].parameters()).device

    def weight_bytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in [*self.parameters(), *self.buffers()])

    def new_cache(self, start: int, end: int, rows: int, capacity: int = 0) -> SessionCache:
        """Empty caches for blocks [start, end) of a session of `rows` sequences (see SessionCache)."""
        layers = [LayerCache(rows, self.kv_heads, self.head_dim, self.dtype, self.device) for _ in range(start, end)]
        cache = SessionCache(layers, rows)
        cache.reserved = capacity
        cache.fit(0)
        return cache

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,  # (rows, new positions, hidden)
        position: int = 0,
        cache: Optional[SessionCache] = None,
        start: Optional[int] = None,
        end: Optional[int] = None,
    ) -> torch.Tensor:
        """One request's new positions through blocks [start, end) (default: the whole span)."""
        segment = Segment(hidden.shape[0], hidden.shape[1], position, cache)
        return self.forward_packed(hidden.reshape(1, -1, hidden.shape[-1]), [segment], start, end).view(hidden.shape)

    @torch.inference_mode()
    def forward_packed(
        self, hidden: torch.Tensor, segments: list[Segment], start: Optional[int] = None, end: Optional[int] = None
    ) -> torch.Tensor:
        """Several requests at once: their new tokens packed as (1, tokens, hidden), segment after segment
        (see PackedBatch); returns the outputs packed the same way."""
        start = self.start if start is None else start
        end = self.end if end is None else end
        if not self.start <= start < end <= self.end:
            raise BadRequestError(f"blocks {start}:{end} are outside this server's span {self.start}:{self.end}")
        hidden = hidden.to(self.device, self.dtype)
        layers = self.layers[start - self.start : end - self.start]
        batch = PackedBatch(segments)
        self.family.batch_inputs(self.position_state, hidden, batch, {layer.attention_window for layer in layers})
        for index, layer in enumerate(layers):
            hidden = self.family.layer_forward(layer, hidden, batch, index)
        return hidden


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
        layer.load_state_dict(state, strict=True, assign=True)
        layer.to(device=device, dtype=dtype)
        if quantization is not None:
            quantize_linears(layer, quantization, dtype)
            layer.to(device)  # bitsandbytes quantizes the weights as they move to the device
        layer.attention_window = family.sliding_window(config, index)
        layers.append(layer.eval())
    kept_prefixes = tuple(family.layer_key.format(index) for index in kept if start <= index < end)
    kept_names = [name for name in (reuse.loaded_names if reuse else []) if name.startswith(kept_prefixes)] \
        if kept_prefixes else []
    return BlockSpan(config, start, end, layers, family, loaded_names=sorted([*tensors, *kept_names]), dtype=dtype,
                     quantization=quantization)


QUANTIZATIONS = ("int8", "nf4")


def quantize_linears(layer: nn.Module, quantization: str, compute_dtype: torch.dtype) -> None:
    """Replace the layer's nn.Linear projections by bitsandbytes' LLM.int8() ("int8") or 4-bit NormalFloat
    ("nf4") ones, as Petals does: a quarter or an eighth of float32's bytes, on CUDA (and, more slowly, on CPU).
    Norms, and GPT-2's Conv1D projections (not nn.Linear), stay as they are."""
    if quantization not in QUANTIZATIONS:
        raise BadRequestError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    import warnings

    import bitsandbytes as bnb

    # said on every forward of an int8 layer on float32 inputs: expected, and it would flood the server's log
    warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")
    for name, module in list(layer.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        bias = module.bias is not None
        if quantization == "int8":
            quantized = bnb.nn.Linear8bitLt(module.in_features, module.out_features, bias, has_fp16_weights=False)
            quantized.weight = bnb.nn.Int8Params(module.weight.data, requires_grad=False, has_fp16_weights=False)
        else:
            quantized = bnb.nn.Linear4bit(module.in_features, module.out_features, bias, compute_dtype=compute_dtype,
                                          quant_type="nf4")
            quantized.weight = bnb.nn.Params4bit(module.weight.data, requires_grad=False, quant_type="nf4")
        if bias:
            quantized.bias = module.bias
        parent, _, child = name.rpartition(".")
        setattr(layer.get_submodule(parent) if parent else layer, child, quantized)


# ------------------------------------------------------------------------------------------- the client


class ClientModules(nn.Module):
    """The client's half of a model: token ids -> hidden states for the first block, and the last block's
    output -> final norm -> logits. Built from the family's ClientSide, from the client's own tensors only."""

    def __init__(self, config, family: Family, tensors: dict):
        super().__init__()
        client = family.client
        self.config, self.family = config, family
        self.loaded_names = sorted(tensors)  # proof that the client read no block's tensors
        embed_weight = tensors[client.embed_key]
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.embed_positions = None
        if client.position_embed_key is not None:
            self.embed_positions = nn.Embedding.from_pretrained(tensors[client.position_embed_key], freeze=True)
        self.embed_norm = None
        if client.embed_norm_prefix is not None:
            self.embed_norm = _load_norm(family, config, client.embed_norm_prefix, tensors)
        self.norm = _load_norm(family, config, client.norm_prefix, tensors)
        head_weight = tensors.get(client.lm_head_key)
        if head_weight is None or getattr(config, "tie_word_embeddings", False):
            head_weight = embed_weight
        with torch.device("meta"):
            self.lm_head = nn.Linear(head_weight.shape[1], head_weight.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(head_weight, requires_grad=False)

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor, position: int = 0) -> torch.Tensor:
        """Token ids (batch, length) at absolute positions position.. -> hidden states (batch, length, hidden)
        as the first block expects them (transformers' hidden_states[0])."""
        hidden = self.embed_tokens(token_ids)
        if self.embed_positions is not None:
            end = position + token_ids.shape[1]
            if end > self.embed_positions.num_embeddings:
                raise SessionLengthError(
                    f"position {end - 1} is past this model's {self.embed_positions.num_embeddings} positions"
                )
            hidden = hidden + self.embed_positions(torch.arange(position, end, device=hidden.device))
        if self.embed_norm is not None:
            hidden = self.embed_norm(hidden)
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last block's output -> final norm -> LM head."""
        return self.lm_head(self.norm(hidden))


def _load_norm(family: Family, config, prefix: str, tensors: dict) -> nn.Module:
    with torch.device("meta"):
        norm = family.client.norm(family, config)
    state = {name[len(prefix):]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}
    norm.load_state_dict(state, strict=True, assign=True)
    return norm.eval()


def load_client(folder: Path, config=None) -> ClientModules:
    """The client's modules of a model folder, reading only their tensors (never any block's)."""
    config = load_config(folder) if config is None else config
    family = family_of(config)
    keys = family.client.keys()
    return ClientModules(config, family, load_tensors(folder, lambda name: name in keys))
