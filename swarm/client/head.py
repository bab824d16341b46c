"""The client's half of a model's weights: embeddings (and learned positions, an embedding norm), the final
norm and the LM head, built from the family's ClientSide (swarm/families/), from the client's tensors only;
with the family's scale of the embeddings and cap of the logits (Gemma), where it has them.

They run on a device and in a dtype of their own (a GPU and bfloat16 take the LM head, the client's largest
matmul, off the CPU), but what they exchange with the rest of the client is always float32 on the CPU:
hidden states for the remote session (which casts them to the wire dtype) and logits for sampling. On the CPU
in float32 every conversion is a no-op, and outputs are bit for bit what they were.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from swarm.families import Family, family_of
from swarm.protocol import SessionLengthError
from swarm.weights import load_config, load_tensors

HOST = torch.device("cpu")


class ClientModules(nn.Module):
    """The client's half of a model: token ids -> hidden states for the first block, and the last block's
    output -> final norm -> logits. Built from the family's ClientSide, from the client's own tensors only."""

    def __init__(self, config, family: Family, tensors: dict, device="cpu", dtype: torch.dtype = torch.float32):
        super().__init__()
        client = family.client
        self.config, self.family = config, family
        self.device, self.dtype = torch.device(device), dtype
        self.loaded_names = sorted(tensors)  # proof that the client read no block's tensors
        # converted before the modules are built, so that a head tied to the embeddings stays one tensor there
        tensors = {name: tensor.to(self.device, dtype) for name, tensor in tensors.items()}
        embed_weight = tensors[client.embed_key]
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.embed_positions = None
        if client.position_embed_key is not None:
            self.embed_positions = nn.Embedding.from_pretrained(tensors[client.position_embed_key], freeze=True)
        # Gemma scales the embeddings by a float32 constant rounded to the model's dtype, as transformers does
        scale = client.embed_scale(config)
        self.embed_scale = None if scale is None else torch.tensor(scale).to(self.device, dtype)
        self.logit_softcap = client.logit_softcap(config)
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
        as the first block expects them (transformers' hidden_states[0]), float32 on the CPU."""
        batch, length = token_ids.shape
        positions = torch.arange(position, position + length).repeat(batch)
        return self.embed_rows(token_ids.reshape(-1), positions).reshape(batch, length, -1)

    @torch.inference_mode()
    def embed_rows(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tokens of many sequences at once, each at its own absolute position: ids (tokens,) and positions
        (tokens,) -> hidden states (tokens, hidden), float32 on the CPU. Every step is row-wise, so each row is
        what embedding its sequence alone gives."""
        hidden = self.embed_tokens(token_ids.to(self.device))
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        if self.embed_positions is not None:
            if len(positions) and int(positions.max()) >= self.embed_positions.num_embeddings:
                raise SessionLengthError(
                    f"position {int(positions.max())} is past this model's {self.embed_positions.num_embeddings} "
                    "positions")
            hidden = hidden + self.embed_positions(positions.to(hidden.device))
        if self.embed_norm is not None:
            hidden = self.embed_norm(hidden)
        return hidden.to(HOST, torch.float32)

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last block's output -> final norm (transformers' last hidden_states), float32 on the CPU."""
        return self.norm(hidden.to(self.device, self.dtype)).to(HOST, torch.float32)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last block's output -> final norm -> LM head, float32 on the CPU (see logits_on_device)."""
        return self.logits_on_device(hidden).to(HOST)

    @torch.inference_mode()
    def logits_on_device(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last block's output (rows, hidden) -> final norm -> LM head -> (rows, vocab), float32 where the head
        runs: the gateway's engine samples there, and only the chosen token ids cross to the host."""
        logits = self.lm_head(self.norm(hidden.to(self.device, self.dtype)))
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits.float()


def _load_norm(family: Family, config, prefix: str, tensors: dict) -> nn.Module:
    with torch.device("meta"):
        norm = family.client.norm(family, config)
    state = {name[len(prefix):]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}
    norm.load_state_dict(state, strict=True, assign=True)
    return norm.eval()


def load_client(folder: Path, config=None, device="cpu", dtype: torch.dtype = torch.float32) -> ClientModules:
    """The client's modules of a model folder, reading only their tensors (never any block's), on `device`
    in `dtype`."""
    config = load_config(folder) if config is None else config
    family = family_of(config)
    keys = family.client.keys()
    return ClientModules(config, family, load_tensors(folder, lambda name: name in keys), device, dtype)
