"""Petals-style generation fields (HTTP /api/v1/generate and WebSocket /api/v2/generate) converted once into the
engine's terms: the token bounds checked, the model's defaults filled in, one GenerationRequest."""

from __future__ import annotations

from typing import Optional

from config import GenerationDefaults, ModelConfig
from gateway.engine.generation import GenerationRequest
from gateway.engine.lengths import check_max_length, check_new_tokens
from gateway.engine.sampling import SamplingParams
from gateway.petals.schemas import GenerationFields


def _pick(value, default):
    return default if value is None else value


def generation_request(fields: GenerationFields, model: ModelConfig, max_new_tokens_cap: int, streaming: bool):
    """A validated request's generation fields as the engine's GenerationRequest, with the model's defaults.

    `streaming` is the WebSocket's stop_sequence mode: generation goes on until a stop sequence or the
    session's length, and max_new_tokens is the size of each streamed chunk instead of a total.
    """
    check_new_tokens("max_new_tokens", fields.max_new_tokens, max_new_tokens_cap)
    check_max_length(model, fields.max_length)
    return GenerationRequest(
        inputs=fields.inputs,
        sampling=sampling_params(fields, model.defaults),
        max_new_tokens=max_new_tokens(fields, model.defaults, streaming),
        max_length=fields.max_length,
        stop_sequences=tuple(fields.stop_sequences()),
    )


def sampling_params(fields: GenerationFields, defaults: GenerationDefaults) -> SamplingParams:
    return SamplingParams(
        do_sample=_pick(fields.do_sample, defaults.do_sample),
        temperature=_pick(fields.temperature, defaults.temperature),
        top_k=_pick(fields.top_k, defaults.top_k),
        top_p=_pick(fields.top_p, defaults.top_p),
        repetition_penalty=_pick(fields.repetition_penalty, defaults.repetition_penalty),
        seed=fields.seed,
    )


def max_new_tokens(fields: GenerationFields, defaults: GenerationDefaults, streaming: bool) -> Optional[int]:
    """The reply's token budget; None when only the session's length (or max_length) bounds it."""
    if streaming:
        return None
    if fields.max_new_tokens is None and fields.max_length is not None:
        return None  # Petals: either bound may be given; max_length alone bounds the whole text
    return _pick(fields.max_new_tokens, defaults.max_new_tokens)
