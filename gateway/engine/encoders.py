"""Embedding models served beside the swarm's chat models: small sentence-transformers encoders (config.py's
EMBEDDING_MODELS) run whole in the gateway's own process. The embeddings routes pick one by its name
(/v1/embeddings and Ai00's /embeds in openai/routes.py, /api/embed and /api/embeddings in ollama/routes.py); a chat
model's name keeps the swarm's hidden states (Engine.embed).

    EmbeddingModels(configs, device)   each folder checked at start-up, without torch: readable, and a
                                       sentence-transformers folder (modules.json naming modules that exist)
    .get(name) -> Encoder | None       the encoder called `name` (None: not an encoder's name)
    Encoder                            loaded by the first request for it, once (the others for it wait); then
        .token_counts(texts)           each text's tokens as the encoder sees them (its prompt and [CLS]/[SEP] in)
        .chunks(text, size)            Ai00's /embeds: the text cut into pieces of at most `size` tokens
        .encode(texts, dimensions, normalize)   one encode call for all of a request's texts

An encoder's vectors are SentenceTransformer(folder).encode's: its own modules say how it pools and whether it
normalizes. `dimensions` keeps the first that many values, normalized again when the model normalizes (as OpenAI's
text-embedding-3 models do), so that a shortened vector is still a unit one.

One request at a time runs on an encoder (its lock): a fast tokenizer's padding and truncation are state of the
tokenizer, which two threads may not change at once ("Already borrowed"), and one encode call already keeps
torch's threads busy; the request holds one of its client's session slots meanwhile (web/limits.work_slot).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Optional

from config import EmbeddingModelConfig
from gateway.errors import APIError, BadRequest, LengthExceeded

logger = logging.getLogger(__name__)

MODULES_FILE = "modules.json"  # what makes a folder a sentence-transformers model


class EmbeddingModelError(ValueError):
    """An EMBEDDING_MODELS folder that cannot be served: the gateway does not start (app.py says why)."""


class Encoder:
    """One sentence-transformers model, loaded by the first request that needs it."""

    def __init__(self, config: EmbeddingModelConfig, device: str):
        self.name, self.folder, self.device = config.name, config.folder, device
        self.family = _family(config.folder)
        self._model = None
        self._lock = threading.Lock()  # loading, and then each use (see the module's docstring)

    def load(self) -> float:
        """Load the model if no request has yet; the seconds it took (0: loaded before, Ollama's load_duration)."""
        if self._model is not None:
            return 0.0
        began = time.perf_counter()
        with self._lock:
            if self._model is None:
                self._model = self._read()
        return time.perf_counter() - began

    def _read(self):
        from sentence_transformers import SentenceTransformer

        try:  # a local folder, never the hub: this machine may have no access to it
            model = SentenceTransformer(str(self.folder), device=self.device, local_files_only=True)
        except Exception:
            logger.exception("embedding model %s could not be loaded from %s", self.name, self.folder)
            raise APIError(f"embedding model {self.name!r} could not be loaded; see the gateway's log") from None
        model.eval()
        logger.info("embedding model %s loaded from %s", self.name, self.folder)
        return model

    @property
    def model(self):
        self.load()
        return self._model

    @property
    def max_tokens(self) -> int:
        """The most tokens of one input the encoder reads (its max_seq_length); past it, sentence-transformers cuts."""
        return self.model.max_seq_length

    @property
    def dimension(self) -> int:
        return self.model.get_embedding_dimension()

    @property
    def normalizes(self) -> bool:
        from sentence_transformers.base.modules import Normalize

        return any(isinstance(module, Normalize) for module in self.model)

    def _prompt(self) -> str:
        """The text encode() puts before each input: the model's default prompt, if it names one."""
        model = self.model
        return model.prompts.get(model.default_prompt_name, "") if model.default_prompt_name else ""

    def token_counts(self, texts: list[str]) -> list[int]:
        model, prompt = self.model, self._prompt()  # loaded before the lock is taken: loading takes it too
        with self._lock:
            encoded = model.tokenizer([prompt + text for text in texts], add_special_tokens=True, verbose=False)
        return [len(ids) for ids in encoded["input_ids"]]

    def check_fits(self, counts: list[int], field: str, listed: bool = True) -> None:
        """Refuse an input longer than the encoder reads, rather than embed only its beginning. `listed`: the field
        holds a list, and the error names the input's index in it."""
        for index, count in enumerate(counts):
            if count > self.max_tokens:
                name = f"{field}[{index}]" if listed else field
                raise LengthExceeded(f"{name}: {count} tokens, more than the {self.max_tokens} that {self.name} "
                                     "reads (its max_seq_length)", field=name)

    def chunks(self, text: str, size: int) -> list[str]:
        """`text` in consecutive pieces of at most `size` tokens (cut where tokens meet, nothing dropped between)."""
        model = self.model
        with self._lock:
            offsets = model.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                                      verbose=False)["offset_mapping"]
        starts = [offsets[index][0] for index in range(0, len(offsets), size)]
        return [text[start:end] for start, end in zip(starts, [*starts[1:], len(text)])]

    def encode(self, texts: list[str], dimensions: Optional[int] = None, normalize: bool = False) -> list[list[float]]:
        """One vector per text, in one encode call; `dimensions` keeps the first values (see the docstring);
        `normalize` makes every vector a unit one whatever the model does (Ollama's /api/embed)."""
        if dimensions is not None and dimensions > self.dimension:
            raise BadRequest(f"dimensions: at most {self.dimension} for {self.name}, got {dimensions}",
                             field="dimensions")
        model, normalize = self.model, normalize or (dimensions is not None and self.normalizes)
        with self._lock:
            vectors = model.encode(texts, convert_to_numpy=True, show_progress_bar=False,
                                        truncate_dim=dimensions, normalize_embeddings=normalize)
        return vectors.tolist()


class EmbeddingModels:
    """The gateway's encoders by name, each folder checked when the engine is built (the gateway's start)."""

    def __init__(self, configs: tuple[EmbeddingModelConfig, ...], device: str = "cpu"):
        for config in configs:
            check_folder(config)
        self._encoders = {config.name: Encoder(config, device) for config in configs}

    def __iter__(self):
        return iter(self._encoders.values())

    def __len__(self) -> int:
        return len(self._encoders)

    def get(self, name: Optional[str]) -> Optional[Encoder]:
        return self._encoders.get(name) if name else None

    def first(self, name: Optional[str]) -> Encoder:
        """The encoder called `name`, or with no name the first configured (Ai00's /embeds names none)."""
        encoder = self.get(name) if name else next(iter(self._encoders.values()), None)
        if encoder is None:
            served = ", ".join(self._encoders) or "none (EMBEDDING_MODELS)"
            raise BadRequest(f"model: {name!r} is not an embedding model; embedding models served: {served}"
                             if name else f"model: no embedding model is served here; served: {served}",
                             field="model")
        return encoder

    def refuse_chat(self, name: Optional[str]) -> None:
        """A chat (or completion, session, ...) request naming an encoder: a 400 naming `model`."""
        if self.get(name) is not None:
            raise BadRequest(f"model: {name!r} is an embedding model: it serves /v1/embeddings (and /v1/embeds, "
                             "Ollama's /api/embed), not generation", field="model")


def check_folder(config: EmbeddingModelConfig) -> None:
    """A readable sentence-transformers folder, or EmbeddingModelError saying what is wrong with it."""
    folder = config.folder
    if not folder.is_dir() or not os.access(folder, os.R_OK | os.X_OK):
        raise EmbeddingModelError(f"EMBEDDING_MODELS: {folder} is not a readable folder")
    try:
        modules = json.loads((folder / MODULES_FILE).read_text())
        missing = [entry["path"] for entry in modules if not (folder / entry["path"]).exists()]
    except FileNotFoundError:
        raise EmbeddingModelError(f"EMBEDDING_MODELS: {folder} is not a sentence-transformers model folder "
                                  f"(no {MODULES_FILE})") from None
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise EmbeddingModelError(f"EMBEDDING_MODELS: {folder / MODULES_FILE} is unreadable or malformed "
                                  f"({type(error).__name__})") from None
    if not modules or missing:
        raise EmbeddingModelError(f"EMBEDDING_MODELS: {folder / MODULES_FILE} names no module, or modules missing "
                                  f"from the folder: {', '.join(missing)}")


def _family(folder: Path) -> str:
    """The encoder's architecture as transformers names it (bert, ...), from its config; "" if it has none."""
    try:
        return str(json.loads((folder / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError, AttributeError):
        return ""
