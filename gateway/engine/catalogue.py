"""Which models the engine serves, which of them it holds loaded, and what the swarm holds of each.

Served: the configured models (config.py's MODEL or MODELS), always; and models the swarm's servers announce
(their catalogue records), only as the operator's DISCOVERED_MODELS says (default: none of them), and only
from this gateway's own model cache. A record is a stranger's word: its name picks a folder of the cache
(SWARM_CACHE_DIR/models/NAME, a name of one path component), never a path of its own, and a record whose block
count differs from that folder's config is ignored. Listing the models and their coverage reads the cached
configs and the DHT, never any weights.

Adapted: "model:adapter" names a served model through a LoRA adapter that the model's servers announce
(python -m swarm.server --adapters); it shares the model's client half (and its grammars and draft model), and
its sessions run only on servers holding the adapter. Each served model lists its adapters, each with the model
as its parent. Any peer may announce hundreds of adapter names: the swarm client names a bounded number of a
model's adapters (SwarmClient.adapter_coverage), with their coverage from one lookup, asked again every few
seconds.

Loaded: a model's client half (embeddings, LM head, tokenizer) is loaded by the first request that uses it,
under a lock of its own (a model loading holds up no request for another), and at most `max_loaded_models`
stay loaded: the least recently used is let go first (sessions open on it keep it until they end, and its engine
loop until then: loop.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from config import MODEL_NAME_PATTERN, ModelConfig, Settings
from gateway.engine.served import CATALOGUE_SECONDS, ServedModel, session_length
from gateway.errors import NotFound, from_exception
from swarm.gc_tuning import freeze_long_lived, thaw
from swarm.protocol import ModelRecord, dht_prefix

ADAPTER_SEPARATOR = ":"  # "model:adapter"
ADAPTER_VIEWS = 256  # "model:adapter" views of loaded models kept (a request for another one makes it again)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    """What routing and listing need of a model, without its weights."""

    prefix: str  # its name in the DHT
    num_blocks: int
    trained_context: Optional[int]  # the config's max_position_embeddings, if it names one


@dataclass(frozen=True)
class Discovered:
    """A model the swarm announces that this gateway may serve, from its own cache."""

    config: ModelConfig
    shape: Shape


def _shape_of(config: ModelConfig, remote) -> Shape:
    """A loaded model's shape (a RemoteModel says its prefix and blocks; a stand-in may only have a config)."""
    prefix = getattr(remote, "prefix", None) or config.dht_prefix or dht_prefix(config.path)
    num_blocks = getattr(remote, "num_blocks", None) or remote.config.num_hidden_layers
    return Shape(prefix, num_blocks, getattr(remote.config, "max_position_embeddings", None))


def split_adapter(name: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """"model:adapter" -> ("model", "adapter"); any other name -> (name, None). Model names never hold a colon
    (config.MODEL_NAME_PATTERN), nor do adapter names (swarm.protocol.ADAPTER_NAME_PATTERN)."""
    if name is None or ADAPTER_SEPARATOR not in name:
        return name, None
    base, _, adapter = name.partition(ADAPTER_SEPARATOR)
    return base, adapter


def read_config(folder: Path):
    """A model folder's config (config.json only: no weights, no code of the model's)."""
    import transformers

    return transformers.AutoConfig.from_pretrained(folder)


class ServedModels:
    """The served models of one engine (see the module's docstring). `connect(model_config) -> RemoteModel`
    loads a model's client half; `swarm_client()` is the process's SwarmClient, or None where there is no
    swarm to ask (the catalogue is then empty)."""

    def __init__(self, settings: Settings, connect: Callable[[ModelConfig], object],
                 swarm_client: Callable[[], object], read_model_config: Callable[[Path], object] = read_config):
        self.gateway, self.cache_dir = settings.gateway, Path(settings.swarm.cache_dir)
        self.max_loaded = settings.gateway.limits.max_loaded_models
        self._connect, self._swarm_client, self._read_config = connect, swarm_client, read_model_config
        self._loaded: OrderedDict[str, ServedModel] = OrderedDict()  # least recently used first
        self._shapes: dict[str, Shape] = {}  # of every model loaded once: listing never loads it again
        self._connecting: dict[str, threading.Lock] = {}  # one per served model: it loads once at a time
        self._lock = threading.Lock()  # guards these dicts and _adapted; held for no load, no network call
        self._catalogue: tuple[float, list[Discovered]] = (-math.inf, [])
        self._catalogue_lock = threading.Lock()  # one thread asks the DHT; the others use the last answer
        self._adapters: dict[str, tuple[float, dict]] = {}  # model -> (when asked, {adapter: its Coverage})
        # "model:adapter" -> its view of the loaded model, the least recently used first
        self._adapted: OrderedDict[str, ServedModel] = OrderedDict()

    # ------------------------------------------------------------------------------- what is served

    def config(self, name: Optional[str]) -> ModelConfig:
        """A configured model (None: the default one), else a discovered one it may serve; 404 otherwise."""
        config = self.gateway.model(name)
        if config is None:
            config = next((found.config for found in self.discovered() if found.config.name == name), None)
        if config is None and split_adapter(name)[1] is not None:
            return self._adapted_config(*split_adapter(name))
        if config is None:
            served = ", ".join(model.name for model in (*self.gateway.models, *self.discovered_configs()))
            raise NotFound(f"unknown model {name!r}; served models: {served}", field="model")
        return config

    def _adapted_config(self, base_name: str, adapter: str) -> ModelConfig:
        """A served model through one of the LoRA adapters its servers announce; 404 for any other adapter."""
        base = self.config(base_name)
        announced = self.adapters(base.name)
        if adapter not in announced:
            raise NotFound(f"unknown model {base_name + ADAPTER_SEPARATOR + adapter!r}: no server of {base.name} "
                           f"announces the adapter {adapter!r} (adapters announced: "
                           f"{', '.join(sorted(announced)) or 'none'})", field="model")
        return replace(base, name=f"{base.name}{ADAPTER_SEPARATOR}{adapter}")

    def adapters(self, name: str) -> frozenset:
        """The LoRA adapters that the servers of a served model announce (asked again every few seconds)."""
        return frozenset(self._adapter_coverage(name))

    def _adapter_coverage(self, name: str) -> dict:
        """{adapter: its swarm.client.Coverage} of a served model's adapters, asked again every few seconds."""
        asked_at, announced = self._adapters.get(name, (-math.inf, {}))
        if time.monotonic() - asked_at >= CATALOGUE_SECONDS:
            shape = self.shape(name)
            try:
                announced = self._client_of(name).adapter_coverage(shape.prefix, shape.num_blocks)
            except Exception:  # servers unreachable now: no adapter is served until they answer
                logger.debug("could not ask the swarm for the adapters of %s", name, exc_info=True)
                announced = {}
            self._adapters[name] = (time.monotonic(), announced)
        return announced

    def discovered_configs(self) -> list[ModelConfig]:
        return [found.config for found in self.discovered()]

    def discovered(self) -> list[Discovered]:
        """The swarm's models this gateway may serve, asked again every few seconds by one thread (the others
        meanwhile use the last answer; only the first answer is waited for)."""
        asked_at, found = self._catalogue
        if self.gateway.discovered_models == "none" or time.monotonic() - asked_at < CATALOGUE_SECONDS:
            return found
        if not self._catalogue_lock.acquire(blocking=asked_at == -math.inf):
            return found  # another thread is asking
        try:
            asked_at, found = self._catalogue
            if time.monotonic() - asked_at >= CATALOGUE_SECONDS:  # else it was asked while this thread waited
                found = self._servable(self._read_catalogue())
                self._catalogue = (time.monotonic(), found)
            return found
        finally:
            self._catalogue_lock.release()

    def _read_catalogue(self) -> list[ModelRecord]:
        try:
            client = self._swarm_client()
            return client.catalogue() if client is not None else []
        except Exception:  # the catalogue is a convenience: the configured models are served regardless
            logger.warning("could not read the swarm's model catalogue", exc_info=True)
            return []

    def _servable(self, records: list[ModelRecord]) -> list[Discovered]:
        configured = self.gateway.models
        known = {model.name for model in configured} | {model.dht_prefix or dht_prefix(model.path)
                                                         for model in configured}
        names = Counter(record.name for record in records)
        found = []
        for record in records:
            if record.name in known or record.prefix in known:
                continue
            if names[record.name] > 1:  # announced under several prefixes: which servers run it is anyone's guess
                logger.debug("model %r is announced under %d prefixes: not served", record.name, names[record.name])
                continue
            discovered = self._from_cache(record)
            if discovered is not None:
                found.append(discovered)
        return found

    def _from_cache(self, record: ModelRecord) -> Optional[Discovered]:
        """The record's model from this gateway's cache, if DISCOVERED_MODELS serves it and its config agrees."""
        if not MODEL_NAME_PATTERN.fullmatch(record.name) or not self.gateway.serves_discovered(record.name):
            return None
        folder = self.cache_dir / "models" / record.name
        if not (folder / "config.json").is_file():
            return None
        try:
            model_config = self._read_config(folder)
        except Exception:
            logger.warning("the cached model %s has an unreadable config", folder, exc_info=True)
            return None
        if getattr(model_config, "num_hidden_layers", None) != record.num_blocks:
            return None  # the swarm's model is not the one cached under that name
        config = ModelConfig(name=record.name, path=str(folder), dht_prefix=record.prefix)
        trained = getattr(model_config, "max_position_embeddings", None)
        return Discovered(config, Shape(record.prefix, record.num_blocks, trained))

    # ------------------------------------------------------------------------------- what is loaded

    def get(self, name: Optional[str]) -> ServedModel:
        """The model's client half, loaded by the first request for it (the others for it wait for that); a
        "model:adapter" shares the model's."""
        config = self.config(name)
        base_name, adapter = split_adapter(config.name)
        if adapter is not None:
            return self._adapted_model(config, self.get(base_name), adapter)
        with self._lock:
            if config.name in self._loaded:
                self._loaded.move_to_end(config.name)
                return self._loaded[config.name]
            connecting = self._connecting.setdefault(config.name, threading.Lock())
        with connecting:
            with self._lock:
                if config.name in self._loaded:
                    self._loaded.move_to_end(config.name)
                    return self._loaded[config.name]
            model = ServedModel(config, self._connect(config))
            # its weights, tokenizer and the swarm client live on: out of every later collection (one let go is
            # still freed by reference counting)
            freeze_long_lived()
            with self._lock:
                self._loaded[config.name] = model
                self._shapes[config.name] = _shape_of(config, model.remote)
                self._evict()
            return model

    def _adapted_model(self, config: ModelConfig, base: ServedModel, adapter: str) -> ServedModel:
        with self._lock:
            adapted = self._adapted.get(config.name)
            if adapted is None or adapted.parent is not base:  # base reloaded (the old view was let go with it)
                adapted = ServedModel(config, base.remote.with_adapter(adapter), parent=base)
            self._adapted[config.name] = adapted
            self._adapted.move_to_end(config.name)
            while len(self._adapted) > ADAPTER_VIEWS:
                self._adapted.popitem(last=False)[1].let_go_of()  # its sessions keep it, a request makes it again
            return adapted

    def _evict(self) -> None:
        while len(self._loaded) > self.max_loaded:
            name, model = self._loaded.popitem(last=False)
            model.let_go_of()  # its views too: their engine loops end once their sessions have
            thaw()  # it was frozen out of collections: its cycles are freed only once thawed
            logger.info("let go of model %s, the least recently used (MAX_LOADED_MODELS=%d)", name, self.max_loaded)

    def loaded(self) -> list[ServedModel]:
        with self._lock:
            return list(self._loaded.values())

    # ------------------------------------------------------------------------------- what the swarm holds

    def shape(self, name: Optional[str]) -> Shape:
        """A model's prefix and blocks (a "model:adapter"'s are the model's): from its load or the catalogue; a
        configured model never loaded loads."""
        config = self.config(split_adapter(self.config(name).name)[0])
        with self._lock:
            shape = self._shapes.get(config.name)
        if shape is None:
            shape = next((found.shape for found in self.discovered() if found.config.name == config.name), None)
        if shape is None:
            self.get(config.name)
            with self._lock:
                shape = self._shapes[config.name]
        return shape

    def listed(self) -> list[dict]:
        """Every configured model (with whether the swarm covers it), and every discovered one it covers;
        no discovered model is loaded for it."""
        listed = []
        served = [(model, True) for model in self.gateway.models] + [(model, False) for model in self.discovered_configs()]
        for config, configured in served:
            entry = {"name": config.name, "max_session_length": config.max_session_length,
                     "source": "config" if configured else "swarm"}
            try:
                entry.update(self.coverage(config.name), max_session_length=self._session_length(config))
            except Exception as error:  # one unreachable model must not hide the others
                entry.update(covered=False, error=from_exception(error).message)
            if configured or entry["covered"]:
                listed.append(entry)
            if entry.get("covered"):
                listed.extend(self._listed_adapters(entry))
        return listed

    def _listed_adapters(self, parent: dict) -> list[dict]:
        """The adapters of a listed model that its servers cover (every block held by a server with it)."""
        listed = []
        for adapter, coverage in sorted(self._adapter_coverage(parent["name"]).items()):
            if coverage.covered:
                name = f"{parent['name']}{ADAPTER_SEPARATOR}{adapter}"
                listed.append({**parent, "name": name, "parent": parent["name"], "adapter": adapter,
                               **_coverage_fields(coverage)})
        return listed

    def _session_length(self, config: ModelConfig) -> int:
        with self._lock:
            model = self._loaded.get(config.name)
        if model is not None:
            return model.max_session_length
        shape = self.shape(config.name)
        return session_length(config, shape.trained_context, lambda: self._longest_session(shape))

    def _longest_session(self, shape: Shape) -> Optional[int]:
        try:
            return self._client_of(None).longest_session(shape.prefix, shape.num_blocks)
        except Exception:  # servers unreachable now: the model's own context stands
            logger.debug("could not ask the swarm how long a session it holds", exc_info=True)
            return None

    def coverage(self, name: Optional[str]) -> dict:
        """Whether the swarm now holds every block of the model, and how many servers serve it."""
        shape = self.shape(name)
        adapter = split_adapter(self.config(name).name)[1]  # its servers: those holding the adapter
        return _coverage_fields(self._client_of(name).coverage(shape.prefix, shape.num_blocks, adapter))

    def health(self, name: Optional[str]):
        """The swarm's servers of the model (swarm.client.SwarmHealth)."""
        shape = self.shape(name)
        return self._client_of(name).health(shape.prefix, shape.num_blocks)

    def _client_of(self, name: Optional[str]):
        """The swarm client a model's lookups go through: its own if loaded (an engine given its own `connect`
        has no other), else the process's."""
        with self._lock:
            model = self._loaded.get(split_adapter(self.config(name).name)[0]) if name is not None else None
        return model.remote.client if model is not None else self._swarm_client()


def _coverage_fields(coverage) -> dict:
    """A swarm.client.Coverage as a listing shows it."""
    return {"num_blocks": coverage.num_blocks, "servers": coverage.servers, "covered": coverage.covered,
            "missing_blocks": coverage.missing_blocks}
