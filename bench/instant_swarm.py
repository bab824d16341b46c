"""A swarm that answers every step at once: the gateway measured alone (`python -m bench.gateway_capacity`).

`InstantRemote` has the face of swarm.client.RemoteModel that the gateway's engine uses (sessions, embeddings of
many rows, steps started without waiting, the LM head), with the model's real tokenizer, embeddings and head,
and no blocks: a step's outputs are its inputs, handed back from an event loop in a thread of its own, as the
swarm client's loop hands back real ones (one call into that loop per tick, one callback per step). So what a
token costs here is what it costs the gateway itself: HTTP or WebSocket, the dialect, the engine loop, sampling,
detokenizing, and those hand-offs; the chain costs nothing.

    gunicorn bench.instant_swarm:app      (MODELS names the model folders whose embeddings and heads to use)
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, Optional, Sequence

import torch


class InstantSession:
    """An open session of no servers: nothing to close, forks of any length."""

    servers, group = 1, 0  # a chain of one "server", in the engine loop's first pipeline group

    def __init__(self, max_length: int):
        self.max_length = max_length

    def fork(self, length: int, max_length: Optional[int] = None) -> "InstantSession":
        return InstantSession(max_length or self.max_length)

    def park(self) -> None:
        pass

    def close(self) -> None:
        pass


class InstantClient:
    """What the gateway asks the swarm client besides steps: every block is covered, by one server."""

    def coverage(self, prefix: str, num_blocks: int, adapter=None):
        from swarm.client.swarm_client import Coverage

        return Coverage(num_blocks, 1, [])

    def longest_session(self, prefix: str, num_blocks: int) -> Optional[int]:
        return None  # the model's own context


class InstantRemote:
    head_device = torch.device("cpu")
    prefix, client = "instant", InstantClient()

    def __init__(self, folder: str):
        import transformers

        from swarm.weights import load_tokenizer

        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        self.config, self.tokenizer = model.config, load_tokenizer(folder)
        self.num_blocks = self.config.num_hidden_layers
        self.embeddings, self.head = model.get_input_embeddings(), model.get_output_embeddings()
        self.stop_token_ids = frozenset({self.config.eos_token_id, self.tokenizer.eos_token_id} - {None})
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="instant-swarm", daemon=True).start()

    def session(self, max_length: int, **_) -> InstantSession:
        return InstantSession(max_length)

    def embed_rows(self, ids: torch.Tensor, positions) -> torch.Tensor:
        with torch.inference_mode():
            return self.embeddings(ids)

    def start_steps(self, steps: Sequence[tuple], on_done: Callable) -> None:
        def answer_all():
            for key, _session, hidden, _position in steps:
                on_done(key, hidden, None)

        self.loop.call_soon_threadsafe(answer_all)

    def logits_on_device(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.head(hidden).float()


def create_instant_app():
    """The gateway's Flask app (config from the environment, as `gunicorn app:app` reads it) over instant swarms."""
    from config import Settings
    from gateway import create_app
    from gateway.engine.generation import Engine

    settings = Settings.from_env()
    return create_app(settings, Engine(settings, connect=lambda model: InstantRemote(model.path)))


def __getattr__(name: str):
    """`app`, made when gunicorn asks for it (importing this module builds nothing)."""
    if name == "app":
        globals()["app"] = create_instant_app()
        return globals()["app"]
    raise AttributeError(name)
