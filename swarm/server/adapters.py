"""LoRA adapters on a block server (--adapters), as Petals serves them: PEFT LoRA folders whose tensors for the
span's blocks are loaded beside the base weights, and applied per request in the same rounds.

Every adapted linear module of the span (a q_proj, a down_proj, ...) becomes an AdaptedLinear: the base module
plus each adapter's low-rank pair (A, B, scaling). A round packs sessions of different adapters, and of none,
side by side (swarm/server/attention.py); the base module runs once over all their tokens, and each adapter
present in the round adds its delta to its own tokens only, all adapters at once (see AdaptedLinear). Which
packed tokens belong to which adapter is the round's (PackedBatch.adapter_tokens), set for the duration of a
forward with `applied`, so that transformers' modules keep their own calls (`attention.q_proj(hidden)`) and
every family works unchanged.

An adapter's name is its folder's name; clients ask for it by that name (the record lists the names).
"""

from __future__ import annotations

import contextlib
import json
import re
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from swarm.protocol import ADAPTER_NAME_PATTERN, BadRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
PEFT_PREFIX = "base_model.model."  # PEFT saves the adapted model's keys under its wrapper's prefix

# the round being computed: (tokens,) the adapter id of each packed token (-1: none); None: no adapter in the round
_ROUND_ADAPTERS: ContextVar[Optional[torch.Tensor]] = ContextVar("round_adapters", default=None)


class AdapterError(BadRequestError):
    """An adapter folder this server cannot serve: said once, at start-up, naming the folder."""


@dataclass(frozen=True)
class LowRank:
    """One adapter's delta on one module: scaling * B(A(x))."""

    down: torch.Tensor  # lora_A: (rank, in_features)
    up: torch.Tensor  # lora_B: (out_features, rank)
    scaling: float


class AdaptedLinear(nn.Module):
    """A linear module (nn.Linear, GPT-2's Conv1D, a quantized one) plus the low-rank deltas of the adapters
    that target it, each applied to its own sessions' tokens of the round.

    The adapters' A matrices are stacked into one (total rank, in) matrix and their B matrices into one (out,
    total rank), so that a round computes every token's low-rank projections at once, zeroes (and scales) the
    columns that are not its own adapter's, and projects back: the same five torch calls per module for one
    adapter or forty, and for one session or sixty-four (what Punica's and S-LoRA's batched kernels do, in
    plain matrix products: a rank is small next to the module's own width)."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        self.deltas: dict[str, LowRank] = {}
        self.down = self.up = self.column_adapters = self.column_scaling = None  # the stacks (see stack)

    def stack(self) -> None:
        """Rebuild the stacked matrices from `deltas` (after an adapter is added or replaced)."""
        deltas = list(self.deltas.items())
        self.down = torch.cat([delta.down for _, delta in deltas])
        self.up = torch.cat([delta.up for _, delta in deltas], dim=1)
        ranks = [delta.down.shape[0] for _, delta in deltas]
        self.column_adapters = torch.tensor([adapter_id(name) for (name, _), rank in zip(deltas, ranks)
                                             for _ in range(rank)], device=self.down.device)
        self.column_scaling = torch.tensor([delta.scaling for (_, delta), rank in zip(deltas, ranks)
                                            for _ in range(rank)], device=self.down.device, dtype=self.down.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        output = self.base(hidden)
        token_adapters = _ROUND_ADAPTERS.get()  # (tokens,) each packed token's adapter id, -1 for none
        if token_adapters is None or self.down is None:
            return output
        low = F.linear(hidden.reshape(-1, hidden.shape[-1]).to(self.down.dtype), self.down)  # (tokens, total rank)
        own = torch.where(token_adapters[:, None] == self.column_adapters, self.column_scaling, 0.0)
        return output.add_(F.linear(low * own, self.up).view(output.shape).to(output.dtype))


_ADAPTER_IDS: dict[str, int] = {}  # adapter name -> its id in this process (rounds and stacks number them alike)


def adapter_id(name: str) -> int:
    return _ADAPTER_IDS.setdefault(name, len(_ADAPTER_IDS))


@contextlib.contextmanager
def applied(adapter_tokens: dict, positions: torch.Tensor) -> Iterator[None]:
    """Within the block, adapted modules add each adapter's delta to its packed tokens (`adapter_tokens`: name ->
    indices; `positions`: the round's (tokens,) positions, whose shape and device the ids take)."""
    token_adapters = None
    if adapter_tokens:
        token_adapters = torch.full_like(positions, -1)
        for name, tokens in adapter_tokens.items():
            token_adapters.index_fill_(0, tokens, adapter_id(name))
    token = _ROUND_ADAPTERS.set(token_adapters)
    try:
        yield
    finally:
        _ROUND_ADAPTERS.reset(token)


# ------------------------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class AdapterFolder:
    """A PEFT LoRA adapter as saved by save_pretrained: its config and tensors (for every block)."""

    name: str
    config: dict
    tensors: dict  # key without PEFT's prefix ("model.layers.3.self_attn.q_proj.lora_A.weight") -> tensor


def read_adapter(folder: Path) -> AdapterFolder:
    """An adapter folder, checked for what this server can apply: plain LoRA on linear modules of the blocks."""
    folder = Path(folder)
    name = folder.resolve().name
    if not ADAPTER_NAME_PATTERN.fullmatch(name):
        raise AdapterError(f"--adapters {folder}: the folder's name {name!r} is the adapter's name, and must be "
                           f"letters, digits, '.', '_' or '-' (at most 128)")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as error:
        raise AdapterError(f"--adapters {folder}: no readable {CONFIG_FILE} ({error})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"--adapters {folder}: {CONFIG_FILE} is not a JSON object")
    _check_config(folder, config)
    return AdapterFolder(name, config, _read_tensors(folder))


def _check_config(folder: Path, config: dict) -> None:
    unsupported = {
        "peft_type": config.get("peft_type") not in ("LORA", None),
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none" or bool(config.get("lora_bias")),
        "modules_to_save": bool(config.get("modules_to_save")),
    }
    named = [key for key, refused in unsupported.items() if refused]
    if named:
        raise AdapterError(f"--adapters {folder}: only plain LoRA adapters of linear modules are served; this one "
                           f"sets {', '.join(f'{key}={config.get(key)!r}' for key in named)}")


def _read_tensors(folder: Path) -> dict:
    path = next((folder / file for file in WEIGHT_FILES if (folder / file).is_file()), None)
    if path is None:
        raise AdapterError(f"--adapters {folder}: no {' or '.join(WEIGHT_FILES)}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(path))
    else:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    return {key.removeprefix(PEFT_PREFIX): tensor for key, tensor in tensors.items()}


def attach_adapters(span, adapters: list[AdapterFolder]) -> None:
    """Give the span's blocks every adapter's deltas for them (replacing those of an adapter of the same name:
    a span moved to other blocks keeps the layers it held, already adapted)."""
    changed = set()
    for adapter in adapters:
        modules = _deltas_by_module(span, adapter)
        for (layer_index, module_name), delta in modules.items():
            adapted = _adapted(span.layers[layer_index - span.start], module_name)
            _check_fits(adapter.name, f"block {layer_index}'s {module_name}", adapted.base, delta)
            adapted.deltas[adapter.name] = delta
            changed.add(adapted)
        span.adapters = frozenset({*span.adapters, adapter.name})
    for adapted in changed:
        adapted.stack()


def _deltas_by_module(span, adapter: AdapterFolder) -> dict:
    """(block index, module name within the block) -> LowRank, for the span's blocks."""
    block_key = re.escape(span.family.layer_key).replace(r"\{\}", r"(\d+)")  # "model.layers.{}." -> a group
    layer_pattern = re.compile(block_key + r"(.+)\.lora_([AB])\.weight")
    pairs: dict[tuple[int, str], dict] = {}
    for key, tensor in adapter.tensors.items():
        match = layer_pattern.fullmatch(key)
        if match is None:
            raise AdapterError(f"adapter {adapter.name}: {key} is not a LoRA weight of a transformer block (only "
                               f"the blocks' linear modules can be adapted on a block server)")
        index, module_name, part = int(match[1]), match[2], match[3]
        if span.start <= index < span.end:
            pairs.setdefault((index, module_name), {})[part] = tensor
    deltas = {}
    for (index, module_name), pair in pairs.items():
        if set(pair) != {"A", "B"} or pair["A"].shape[0] != pair["B"].shape[1]:
            raise AdapterError(f"adapter {adapter.name}: block {index}'s {module_name} lacks a matching lora_A/lora_B")
        scaling = _scaling(adapter.config, f"{span.family.layer_key.format(index)}{module_name}", pair["A"].shape[0])
        down, up = (pair[part].to(span.device, span.dtype) for part in "AB")
        deltas[(index, module_name)] = LowRank(down, up, scaling)
    return deltas


def _scaling(config: dict, module_path: str, rank: int) -> float:
    """PEFT's scaling: lora_alpha / r (or / sqrt(r) with rsLoRA), alpha_pattern overriding alpha by module."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?{pattern}$", module_path):
            alpha = value
            break
    return alpha / (rank ** 0.5 if config.get("use_rslora") else rank)


def _check_fits(name: str, where: str, module: nn.Module, delta: LowRank) -> None:
    """An adapter made for another model (other sizes) is refused at start-up, not at a request's first step."""
    expected = (getattr(module, "in_features", None), getattr(module, "out_features", None))
    found = (delta.down.shape[1], delta.up.shape[0])
    if any(size is not None and size != have for size, have in zip(expected, found)):
        raise AdapterError(f"adapter {name}: {where} is {expected[0]} -> {expected[1]} here, but the adapter's is "
                           f"{found[0]} -> {found[1]} (an adapter of another model?)")


def _adapted(layer: nn.Module, module_name: str) -> AdaptedLinear:
    """The block's module of that name, wrapped as an AdaptedLinear (once)."""
    try:
        module = layer.get_submodule(module_name)
    except AttributeError:
        raise AdapterError(f"an adapter targets {module_name}, which this model's blocks do not have") from None
    if isinstance(module, AdaptedLinear):
        return module
    parent_name, _, child = module_name.rpartition(".")
    adapted = AdaptedLinear(module)
    setattr(layer.get_submodule(parent_name) if parent_name else layer, child, adapted)
    return adapted
