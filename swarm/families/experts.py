"""Mixtures of experts (Qwen3-MoE): the layer's sparse block is transformers' own, called once per round on every
packed token (router, then all the token-expert pairs batched), never a Python loop over tokens. What the registry
adds: which of transformers' expert implementations runs, and the checkpoint's per-expert tensors stacked into
the module's parameters at load."""

from __future__ import annotations

import re

import torch


def grouped_experts(config):
    """Qwen3-MoE: the experts as transformers' from_pretrained runs them ("grouped_mm": the round's token-expert
    pairs sorted by expert, one grouped matmul per projection for all of them; in bfloat16 on CUDA no host sync, so
    CUDA graphs capture it, and where torch's grouped kernel falls back (other dtypes) a failed capture leaves the
    rounds eager). A layer built from a bare config would loop over the experts, syncing with the host each time."""
    config._experts_implementation = "grouped_mm"
    return config


EXPERT_KEY = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def stacked_experts(state: dict) -> dict:
    """Qwen3-MoE checkpoints hold each expert's projections (mlp.experts.<e>.gate_proj.weight, ...); transformers'
    module holds them stacked, gate and up concatenated: mlp.experts.gate_up_proj (experts, 2 * intermediate,
    hidden) and mlp.experts.down_proj (experts, hidden, intermediate), as its from_pretrained converts them."""
    experts: dict[str, dict[int, torch.Tensor]] = {}
    converted = {}
    for name, tensor in state.items():
        match = EXPERT_KEY.fullmatch(name)
        if match is None:
            converted[name] = tensor
        else:
            experts.setdefault(match[2], {})[int(match[1])] = tensor
    if experts:
        stacked = {part: torch.stack([by_index[index] for index in sorted(by_index)])
                   for part, by_index in experts.items()}
        converted["mlp.experts.gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1)
        converted["mlp.experts.down_proj"] = stacked["down_proj"]
    return converted
