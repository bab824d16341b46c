"""A small draft model beside a served model (its DRAFT_MODEL, or `draft_model` in MODELS): speculative decoding's
guesses where prompt lookup has none (speculation.py).

It runs in the gateway's process, on the CPU, greedily: a guess is its argmax, and speculation.py keeps a guess
only when it is the token the served model chooses, so replies stay exactly the served model's whatever the draft
model says. It must share the served model's tokenizer (checked when it loads): its guesses are token ids.
Each reply drafts with a cache of its own (ReplyDrafts), cut back to what the reply kept after each step.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Optional

from gateway.engine.warm import shared_prefix

logger = logging.getLogger(__name__)


class DraftModel:
    """A causal LM loaded with transformers; one per served model, shared by its replies (each has its own cache)."""

    def __init__(self, folder: Path, tokenizer):
        import torch
        import transformers

        self.folder = Path(folder)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(self.folder, dtype=torch.float32).eval()
        draft_tokenizer = transformers.AutoTokenizer.from_pretrained(self.folder)
        if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"the draft model {self.folder} has another tokenizer than the model it drafts for: "
                             "its guesses would be other tokens")
        self.positions = getattr(self.model.config, "max_position_embeddings", None) or 2048

    def reply(self) -> "ReplyDrafts":
        return ReplyDrafts(self)


class ReplyDrafts:
    """One reply's guesses: the draft model's cache holds `seen`, the tokens it has read so far."""

    def __init__(self, draft: DraftModel):
        import transformers

        self.draft = draft
        self.cache = transformers.DynamicCache()
        self.seen: list[int] = []

    def propose(self, tokens: list[int], most: int) -> list[int]:
        """Up to `most` greedy guesses at what follows `tokens` (the reply's whole context)."""
        if most <= 0 or not tokens or len(tokens) + most > self.draft.positions:
            return []
        import torch

        with torch.inference_mode():
            logits = self._read(tokens)
            guesses = [int(logits.argmax())]
            while len(guesses) < most:
                logits = self._forward([guesses[-1]])
                guesses.append(int(logits.argmax()))
        return guesses

    def _read(self, tokens: list[int]):
        """The draft model's logits after `tokens`, reading only what its cache does not hold yet."""
        common = shared_prefix(self.seen, tokens)
        common = min(common, len(tokens) - 1)  # at least one token to read: its logits are the first guess's
        if common < len(self.seen):
            self.cache.crop(common - len(self.seen))  # a negative count: the tokens to drop
            del self.seen[common:]
        return self._forward(tokens[common:])

    def _forward(self, new: list[int]):
        import torch

        logits = self.draft.model(torch.tensor([new]), past_key_values=self.cache, use_cache=True).logits
        self.seen.extend(new)
        return logits[0, -1]


class DraftModels:
    """Each served model's draft model, loaded once on first use, and shared by the model's "model:adapter" views
    (ServedModel.parent: the draft model guesses tokens, and every view has the model's tokenizer); a draft model
    that cannot load is logged once and left out (replies then draft by prompt lookup alone)."""

    def __init__(self, cache_dir: Path):
        self.cache_dir = Path(cache_dir)
        self._loaded: dict[str, Optional[DraftModel]] = {}
        self._lock = threading.Lock()

    def of(self, served) -> Optional[DraftModel]:
        name = served.configured.draft_model
        if not name:
            return None
        served = served.parent
        with self._lock:
            if served.name not in self._loaded:
                self._loaded[served.name] = self._load(name, served)
            return self._loaded[served.name]

    def _load(self, name: str, served) -> Optional[DraftModel]:
        from swarm.client import resolve_model

        try:
            return DraftModel(resolve_model(name, self.cache_dir, whole=True), served.tokenizer)
        except Exception as error:  # a misconfigured draft model slows replies down; it must not fail them
            logger.error("draft model %s of %s not used: %s", name, served.name, error)
            return None
