"""The client's half of a model: embeddings -> remote blocks -> final norm -> LM head.

    model = RemoteModel.from_pretrained("SmolLM2-135M-Instruct", initial_peers=[...])
    with model.session(max_length=512) as session:
        logits = session.step(prompt_ids)        # (batch, vocab) for the last new position
        logits = session.step([[next_token]])    # only the new token travels; servers keep the cache

The embeddings, final norm and LM head run in this process, on the CPU in float32 unless given a device and a
dtype (RemoteModel.from_pretrained(..., device="cuda", dtype=torch.bfloat16)); logits come back as float32 on
the CPU either way.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from swarm.client import convoy
from swarm.client.coalesce import Coalescer
from swarm.client.head import load_client
from swarm.client.remote_session import RemoteSession
from swarm.client.stage_clock import CLOCK, now
from swarm.client.swarm_client import SwarmClient
from swarm.protocol import dht_prefix
from swarm.weights import load_config, load_tokenizer, resolve_model


class RemoteModel:
    def __init__(self, folder: Path, client: SwarmClient, name: str, prefix: Optional[str] = None,
                 device="cpu", dtype: torch.dtype = torch.float32):
        """`device` and `dtype`: where this process runs its half of the model (embeddings, final norm, LM
        head); hidden states and logits still leave it as float32 on the CPU (see swarm/client/head.py)."""
        self.folder, self.client, self.name = Path(folder), client, name
        self.prefix = prefix or dht_prefix(name)
        self.adapter: Optional[str] = None  # the LoRA adapter its blocks run with (see with_adapter)
        self.config = load_config(self.folder)
        self.num_blocks = self.config.num_hidden_layers
        self._tokenizer = None

        # the family says how token ids become hidden states and hidden states logits; only the client's tensors
        # are read, never any block's weights
        self.client_modules = load_client(self.folder, self.config, device, dtype)
        # sessions decoding at once in other threads share one pass through the LM head (see swarm/client/coalesce.py)
        self._head = Coalescer(self.client_modules.logits)

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, initial_peers: Sequence[str], cache_dir: Path, prefix: Optional[str] = None,
        name: Optional[str] = None, device="cpu", dtype: torch.dtype = torch.float32, **client_settings,
    ) -> "RemoteModel":
        """`name` is what errors call the model (default: name_or_path); `prefix` its name in the DHT
        (default: derived from name_or_path, as servers derive it); `device` and `dtype` where its embeddings and
        LM head run; `client_settings` go to SwarmClient (wire_dtype, allowed_servers, spot_check_rate, ...)."""
        client = SwarmClient(initial_peers, **client_settings)
        return cls.on_client(client, name_or_path, cache_dir, prefix, name, device=device, dtype=dtype)

    @classmethod
    def on_client(cls, client: SwarmClient, name_or_path: str, cache_dir: Path, prefix: Optional[str] = None,
                  name: Optional[str] = None, device="cpu", dtype: torch.dtype = torch.float32,
                  revision: str = "main") -> "RemoteModel":
        """A model served through an existing client (one DHT node for every model of a process); its prefix
        defaults to the one servers derive from the same name_or_path; `revision`: of a Hugging Face Hub id's."""
        folder = resolve_model(name_or_path, cache_dir, revision)
        return cls(folder, client, name or name_or_path, prefix or dht_prefix(name_or_path), device, dtype)

    def with_adapter(self, adapter: str) -> "RemoteModel":
        """The same model through a LoRA adapter that servers announce (python -m swarm.server --adapters):
        its sessions and forwards run on servers holding it, named "name:adapter" in errors. It shares this
        model's client half (embeddings, LM head, tokenizer): LoRA adapts the blocks only."""
        adapted = copy.copy(self)
        adapted.adapter, adapted.name = adapter, f"{self.name}:{adapter}"
        return adapted

    def embed(self, token_ids, position: int = 0) -> torch.Tensor:
        """Token ids (batch, length) at absolute positions position.. -> the first block's input."""
        return self.client_modules.embed(_as_batch(token_ids), position)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last block's output (rows, hidden) -> final norm -> LM head -> (rows, vocab), float32 on the CPU."""
        return self._head(hidden)

    # ---- what an engine loop stepping many sessions at once uses (gateway/engine/loop.py) ----

    def embed_rows(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tokens of many sessions in one call: ids (tokens,) at their positions (tokens,) -> (tokens, hidden)."""
        return self.client_modules.embed_rows(token_ids, positions)

    @property
    def head_device(self) -> torch.device:
        """Where the LM head runs, and the engine samples."""
        return self.client_modules.device

    def logits_on_device(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, hidden) -> (rows, vocab) float32 on the head's device, with no merging across threads."""
        return self.client_modules.logits_on_device(hidden)

    def start_steps(self, steps: Sequence[tuple[object, "InferenceSession", torch.Tensor, int]],
                    on_done: Callable[[object, Optional[torch.Tensor], Optional[BaseException]], None]) -> None:
        """Start each (key, session, hidden (1, length, hidden), position) through its chain without waiting;
        `on_done(key, outputs, error)` is called on the client's event loop as each ends. They all start in one
        turn of the loop, so that the steps bound for one server leave in one message (see stubs.StepChannel), and
        the sessions that share a chain move through it as one (swarm/client/convoy.py); a failover runs inside
        its own session's step, never holding the others."""

        handed = now()

        def start_all():
            started = now()
            CLOCK.add("client_handoff", started - handed, len(steps))
            convoy.start_steps([(key, session.blocks, hidden, position) for key, session, hidden, position in steps],
                               on_done, started)

        self.client.loop.loop.call_soon_threadsafe(start_all)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.folder)
        return self._tokenizer

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end a generation: the config's end-of-sequence ids and the tokenizer's. Every
        generation loop (the gateway's engine, `python -m swarm.client.generate`) stops on exactly these."""
        eos = self.config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def session(self, max_length: int, batch_size: int = 1,
                on_wait: Optional[Callable[[str], None]] = None) -> "InferenceSession":
        """A session on the swarm's servers; while no server holds some of its blocks, it waits for one (the
        client's block_wait at most), telling `on_wait(message)`, if given (see InferenceSession.on_wait)."""
        blocks = self.client.open_session(self.prefix, self.num_blocks, self.name, max_length, batch_size, on_wait,
                                          self.adapter)
        return InferenceSession(self, blocks)

    @torch.inference_mode()
    def forward(self, token_ids) -> torch.Tensor:
        """Logits of every position of whole sequences, with no session: (batch, length, vocab)."""
        return self.client_modules.logits(self._blocks_output(token_ids, self.num_blocks))

    @torch.inference_mode()
    def hidden_states(self, token_ids, layer: Optional[int] = None) -> torch.Tensor:
        """Hidden states of whole sequences after `layer` blocks, as transformers' hidden_states[layer]:
        0 is the embeddings, num_blocks (the default) the last block's output after the final norm.
        Only the blocks up to `layer` run on the swarm."""
        layer = self.num_blocks if layer is None else layer
        hidden = self._blocks_output(token_ids, layer)
        return self.client_modules.final_norm(hidden) if layer == self.num_blocks else hidden

    def _blocks_output(self, token_ids, layer: int) -> torch.Tensor:
        hidden = self.embed(token_ids, position=0)  # (batch, length, hidden)
        if layer > 0:
            hidden = self.client.forward_blocks(self.prefix, self.num_blocks, self.name, hidden, end=layer,
                                                adapter=self.adapter)
        return hidden

    def close(self) -> None:
        self.client.shutdown()


class InferenceSession:
    """Token ids in, next-token logits out; the swarm's servers hold the attention cache between steps."""

    def __init__(self, model: RemoteModel, blocks: RemoteSession):
        self.model = model
        self.blocks = blocks  # the session on the servers of the chain, which hold its cache

    @property
    def position(self) -> int:
        return self.blocks.position

    @property
    def max_length(self) -> int:
        return self.blocks.max_length

    @property
    def servers(self) -> int:
        """How many servers its chain has now."""
        return len(self.blocks.hops)

    @property
    def group(self) -> int:
        """Its group: its steps travel to each server with their group's (see swarm/client/step_channel.py)."""
        return self.blocks.group

    @group.setter
    def group(self, group: int) -> None:
        self.blocks.group = group

    @property
    def on_wait(self) -> Optional[Callable[[str], None]]:
        """Told `message` (e.g. "no server holds blocks 2..3 of tiny; waiting up to 30 s") once each time the
        session waits for a server of some of its blocks (servers restarting); None: nobody is told."""
        return self.blocks.on_wait

    @on_wait.setter
    def on_wait(self, hook: Optional[Callable[[str], None]]) -> None:
        self.blocks.on_wait = hook

    @torch.inference_mode()
    def step(self, token_ids, position: Optional[int] = None, every_position: bool = False) -> torch.Tensor:
        """Feed new tokens (batch, length) and get the logits after the last one: (batch, vocab); or, with
        `every_position`, after each of them: (batch, length, vocab), what verifying a draft needs. A position
        below the session's length rewinds it: the servers drop what followed."""
        position = self.blocks.position if position is None else position  # absolute position of the new tokens
        hidden = self.model.embed(token_ids, position)  # (batch, length, hidden)
        hidden = self.blocks.step(hidden, position)
        if not every_position:
            return self.model.logits(hidden[:, -1])
        batch, length, width = hidden.shape
        return self.model.logits(hidden.reshape(batch * length, width)).reshape(batch, length, -1)

    def park(self) -> None:
        """Keep this session for reuse while it has no step to send: its servers may close it to make room, and
        its next step (which un-parks it) then recomputes what they dropped, with the same outputs."""
        self.blocks.park()

    def fork(self, length: int, max_length: Optional[int] = None) -> "InferenceSession":
        """A new session continuing from this one's first `length` positions (a saved prefix, a conversation's
        common part): its servers share those positions' cache with this session instead of recomputing it
        (copy-on-write). Both go on independently; max_length defaults to this session's."""
        return InferenceSession(self.model, self.blocks.fork(length, max_length))

    def close(self) -> None:
        self.blocks.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def _as_batch(token_ids) -> torch.Tensor:
    token_ids = torch.as_tensor(token_ids, dtype=torch.long)
    return token_ids if token_ids.ndim == 2 else token_ids[None, :]
