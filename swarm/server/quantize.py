"""Quantized block weights with bitsandbytes (--quantize int8|nf4), as Petals stores them."""

from __future__ import annotations

import torch
from torch import nn

from swarm.protocol import BadRequestError
from swarm.server.settings import QUANTIZATIONS


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
