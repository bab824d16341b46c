"""Settings of every process in this repository, and the only module that reads os.environ.

Each command-line tool takes its defaults from here, so an operator can set them once in the environment:

    SWARM_CACHE_DIR   where converted models live (default: $XDG_CACHE_HOME/swarm-gateway or ~/.cache/...)
    INITIAL_PEERS     space- or comma-separated multiaddrs of DHT peers to join
    WIRE_DTYPE        how a client sends hidden states to servers: float32 (default, exact), bfloat16 or float16
    TORCH_THREADS     torch's threads in each process (the gateway's, and block servers' without --threads)
    ALLOWED_SERVERS   a private swarm's servers (peer ids, space- or comma-separated): clients route only to them
    ALLOWED_CLIENTS   the only peers a block server serves (default: anyone); ALLOWED_SERVERS may push to it too
    FLOWING_STEPS     whether steps flow down the chain by the servers' pushes: 1 always, 0 never, unset (default)
                      where the round trips make it pay; PUSHED_STEPS=0: relayed steps ask for no push (default 1)
    AUDIT_RATE        the chance (0..1, default 0: off; 0.3 catches what one audit catches within 1,000 tokens) that a
                      client has another server recompute each hop of an ended session, and distrusts a server caught
                      lying (swarm/client/audits.py; why off by default: docs/security.md)
    SPOT_CHECK_RATE   the chance (0..1, default 0: off) that a client re-checks a step's outputs on another server
                      at once, the session waiting (the synchronous check, for the paranoid)
    BLOCK_WAIT_SECONDS  seconds a request waits where no server holds some of its blocks, then fails (default 30)
    MODEL             the model served by default (a known name, a local Hugging Face folder, or a Hugging Face Hub
                      id, ORG/NAME, fetched into the Hub's cache: HF_HOME, HF_TOKEN, HF_HUB_OFFLINE are the Hub's own)
    MODEL_REVISION    of a Hub model: the branch, tag or commit served (default: main)
    MODELS            the gateway's served models, as a JSON list of ModelConfig fields, e.g.
                      [{"name": "tiny", "path": "/models/tiny", "dht_prefix": "tiny", "max_session_length": 512}]
    EMBEDDING_MODELS  local sentence-transformers folders (space- or comma-separated) run in the gateway's process
                      beside the chat models, each served under its folder's name (gateway/engine/encoders.py)
    DISCOVERED_MODELS which models the swarm announces, besides MODEL or MODELS, the gateway serves: none (default),
                      cached (those whose files are in its own cache, SWARM_CACHE_DIR/models/NAME), or a list of
                      such names; a model is never loaded from a path a swarm record names
    MAX_SESSIONS, ... every field of Limits in capitals: the gateway's limits and its engine loop's policies
                      (speculation, the pipeline, turns); gunicorn's threads are sized from the limits
    API_KEYS, API_KEY_FILE, ALLOWED_ORIGINS, ALLOWED_METHODS, ALLOWED_HEADERS, ALLOW_CREDENTIALS, TRUSTED_PROXIES
                      who may call the APIs (see AccessSettings)
    KEYLESS_SHARING   without API keys, whether everyone behind one address is one trusted user, sharing saved states,
                      MLC's stateful chat and warm prefixes (1), or not (0: those routes say 403; see AccessSettings);
                      unset: 1 where the gateway listens on loopback only (a laptop's own), else 0 (gunicorn.conf.py)
    SESSION_STORE     where the gateway keeps its inference sessions (token ids and settings) so that they outlive a
                      restart: an SQLite file (default: SWARM_CACHE_DIR/sessions.sqlite3), or off (memory only)
    LOG_LEVEL         the gateway's log level (default INFO)
    GATEWAY_DEVICE    where the gateway runs its half of each model (embeddings, final norm, LM head): cpu, cuda[:N]
    GATEWAY_DTYPE     that half's weights: float32 (default, exact), bfloat16 or float16
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from limits import MAX_SPECULATIVE_TOKENS, Limits  # noqa: F401 (read here with every other setting)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
WIRE_DTYPES = ("float32", "bfloat16", "float16")
GATEWAY_DTYPES = WIRE_DTYPES
# a model's name as a folder of the model cache: one path component, never a path (swarm records name models)
MODEL_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
GATEWAY_DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]+)?")  # as torch names it (app.py checks it is there)
_YES_NO = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def _split_list(value: str) -> tuple[str, ...]:
    return tuple(item for item in re.split(r"[\s,]+", value) if item)


def said(name: str, environ: Mapping[str, str] = os.environ, strict: bool = False) -> bool | None:
    """A yes-or-no setting (1, true, yes; 0, false, no), or None unset or "auto" (FLOWING_STEPS: where it pays;
    KEYLESS_SHARING: by where the gateway listens); `strict`: any other value is refused, else read as unset."""
    value = environ.get(name, "").strip().lower()
    if strict and value not in _YES_NO and value not in ("", "auto"):
        raise ValueError(f"{name} must be 1 or 0 (true or false, yes or no), got {environ[name]!r}")
    return _YES_NO.get(value)


def _positive_int(environ: Mapping[str, str], name: str) -> int | None:
    if not environ.get(name):
        return None
    if not environ[name].isdigit() or int(environ[name]) < 1:
        raise ValueError(f"{name} must be a positive integer, got {environ[name]!r}")
    return int(environ[name])


def _float(environ: Mapping[str, str], name: str, default: float) -> float:
    try:
        return float(environ.get(name) or default)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {environ[name]!r}") from None


def _default_cache_dir(environ: Mapping[str, str]) -> Path:
    if environ.get("SWARM_CACHE_DIR"):
        return Path(environ["SWARM_CACHE_DIR"]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "swarm-gateway"


def _session_store(environ: Mapping[str, str]) -> str | None:
    setting = environ.get("SESSION_STORE", "").strip()
    if setting.lower() in ("off", "none", "memory"):
        return None
    return setting or str(_default_cache_dir(environ) / "sessions.sqlite3")


# hops of ended sessions audited (swarm/client/audits.py): off until the judge's thresholds follow each model (they
# are calibrated on the default model's; docs/security.md)
DEFAULT_AUDIT_RATE = 0.0


@dataclass(frozen=True)
class SwarmSettings:
    """What a block server, a bootstrap peer or a swarm client needs to know before it starts."""

    cache_dir: Path
    model: str = DEFAULT_MODEL
    revision: str = "main"  # of a model named by its Hugging Face Hub id
    initial_peers: tuple[str, ...] = ()
    # a server re-announces itself this often; its records expire after 3 periods (a dead one leaves routing then)
    announce_period: float = 10.0
    cache_tokens: int = 32768
    wire_dtype: str = "float32"
    torch_threads: int | None = None  # None: torch's choice (one per core)
    allowed_servers: tuple[str, ...] = ()  # empty: any server
    allowed_clients: tuple[str, ...] = ()  # empty: any client
    spot_check_rate: float = 0.0
    audit_rate: float = DEFAULT_AUDIT_RATE
    block_wait_seconds: float = 30.0  # a gap in the swarm's blocks is waited out this long (SwarmClient's block_wait)
    # a WAN on one machine: --simulated-latency's default, and --network-map's (a map: swarm/network_map.py)
    simulated_latency_ms: float = 0.0
    network_map: str | None = None

    def __post_init__(self):
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"WIRE_DTYPE must be one of {', '.join(WIRE_DTYPES)}, got {self.wire_dtype!r}")
        if not 0.0 <= self.spot_check_rate <= 1.0:
            raise ValueError(f"SPOT_CHECK_RATE must be between 0 and 1, got {self.spot_check_rate}")
        if not 0.0 <= self.audit_rate <= 1.0:
            raise ValueError(f"AUDIT_RATE must be between 0 and 1, got {self.audit_rate}")
        if not 0.0 <= self.block_wait_seconds <= 3600.0:  # NaN fails too
            raise ValueError(f"BLOCK_WAIT_SECONDS must be between 0 and 3600, got {self.block_wait_seconds}")
        if not 0.0 <= self.simulated_latency_ms <= 60000.0:
            raise ValueError(f"SIMULATED_LATENCY_MS must be between 0 and 60000, got {self.simulated_latency_ms}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "SwarmSettings":
        return cls(
            cache_dir=_default_cache_dir(environ),
            model=environ.get("MODEL", DEFAULT_MODEL), revision=environ.get("MODEL_REVISION") or "main",
            initial_peers=_split_list(environ.get("INITIAL_PEERS", "")),
            wire_dtype=environ.get("WIRE_DTYPE", "float32"), torch_threads=_positive_int(environ, "TORCH_THREADS"),
            allowed_servers=_split_list(environ.get("ALLOWED_SERVERS", "")),
            allowed_clients=_split_list(environ.get("ALLOWED_CLIENTS", "")),
            spot_check_rate=float(environ.get("SPOT_CHECK_RATE") or 0.0),
            audit_rate=_float(environ, "AUDIT_RATE", DEFAULT_AUDIT_RATE),
            block_wait_seconds=_float(environ, "BLOCK_WAIT_SECONDS", 30.0),
            simulated_latency_ms=_float(environ, "SIMULATED_LATENCY_MS", 0.0),
            network_map=environ.get("NETWORK_MAP", "").strip() or None,
        )


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request gets for each generation parameter it leaves out."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 128


@dataclass(frozen=True)
class ModelConfig:
    name: str  # what clients call it
    path: str  # a known model name, a local Hugging Face folder or a Hugging Face Hub id (ORG/NAME)
    dht_prefix: str | None = None  # its name in the DHT; by default derived from path
    # None: what the model was trained for, bounded by what the swarm's servers hold (set it to cap sessions lower)
    max_session_length: int | None = None
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    # a small model of the same tokenizer (a known name, a local folder, or a Hub id fetched whole at first use), run
    # in the gateway to guess tokens for speculative decoding where prompt lookup has no guess (gateway/engine/
    # drafts.py); None: prompt lookup alone
    draft_model: str | None = None
    revision: str = "main"  # of a Hub model: the branch, tag or commit (its servers must serve the same)

    @classmethod
    def from_dict(cls, fields: dict) -> "ModelConfig":
        fields = dict(fields)
        fields.setdefault("path", fields.get("name"))
        defaults = GenerationDefaults(**fields.pop("defaults", {}))
        return cls(defaults=defaults, **fields)


@dataclass(frozen=True)
class EmbeddingModelConfig:
    """An encoder served in the gateway's own process (EMBEDDING_MODELS): a local sentence-transformers folder."""

    name: str  # what clients call it: the folder's name
    folder: Path

    @classmethod
    def from_folder(cls, folder: str) -> "EmbeddingModelConfig":
        path = Path(folder).expanduser()
        if not MODEL_NAME_PATTERN.fullmatch(path.name):
            raise ValueError(f"EMBEDDING_MODELS: {folder!r} is served under its folder's name, which must be letters, "
                             "digits, '.', '_' or '-' (at most 128, starting with a letter or digit)")
        return cls(name=path.name, folder=path)


def _embedding_models(value: str) -> tuple[EmbeddingModelConfig, ...]:
    return tuple(EmbeddingModelConfig.from_folder(folder) for folder in _split_list(value))


@dataclass(frozen=True)
class AccessSettings:
    """Who may call the APIs: API keys (none configured: open) and the CORS allowlists (MLC's server flags)."""

    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # How many reverse proxies in front of the gateway to believe about the client's address (X-Forwarded-For):
    # the per-client limits go by that address when no API key identifies the client. 0: the socket's peer.
    trusted_proxies: int = 0
    # Without keys a caller is only its address, which everyone behind one NAT or proxy shares: whether they are one
    # trusted user (KEYLESS_SHARING), who may continue each other's MLC conversations, use each other's saved states
    # and warm prefixes. Off, those routes are refused; only a request's own cache_salt continues an earlier one.
    keyless_sharing: bool = False

    @property
    def keeps_caller_state(self) -> bool:
        """Whether what a caller leaves between requests (conversations, saved states, warm prefixes) may be kept
        for it: each caller has a key, or the keyless callers are one trusted user."""
        return bool(self.api_keys) or self.keyless_sharing

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "AccessSettings":
        keys = list(_split_list(environ.get("API_KEYS", "")))
        if environ.get("API_KEY_FILE"):
            keys += Path(environ["API_KEY_FILE"]).expanduser().read_text().split()
        lists = {name: _split_list(environ[name.upper()]) for name in ("allowed_origins", "allowed_methods",
                                                                      "allowed_headers") if environ.get(name.upper())}
        return cls(api_keys=tuple(keys), allow_credentials=said("ALLOW_CREDENTIALS", environ, strict=True) or False,
                   trusted_proxies=int(environ.get("TRUSTED_PROXIES") or 0),
                   keyless_sharing=said("KEYLESS_SHARING", environ, strict=True) or False, **lists)


@dataclass(frozen=True)
class GatewaySettings:
    models: tuple[ModelConfig, ...]
    limits: Limits = field(default_factory=Limits)
    access: AccessSettings = field(default_factory=AccessSettings)
    log_level: str = "INFO"
    # where the gateway's half of each model runs (embeddings, final norm, LM head: a GPU takes the head's matmul)
    device: str = "cpu"
    dtype: str = "float32"
    # DISCOVERED_MODELS: which models the swarm announces besides `models` are served: none, cached, or names
    discovered_models: str = "none"
    # SESSION_STORE: the SQLite file that keeps sessions across restarts (from_env: one in the cache); None: memory
    session_store: str | None = None
    # encoders served beside the chat models, in this process (EMBEDDING_MODELS): their names are the folders'
    embedding_models: tuple[EmbeddingModelConfig, ...] = ()

    def __post_init__(self):
        names = _split_list(self.discovered_models)
        if self.discovered_models not in ("none", "cached") and (
                not names or not all(MODEL_NAME_PATTERN.fullmatch(name) for name in names)):
            raise ValueError(f"DISCOVERED_MODELS must be none, cached or a list of model names (one folder name "
                             f"each, no paths), got {self.discovered_models!r}")
        if not GATEWAY_DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"GATEWAY_DEVICE must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in GATEWAY_DTYPES:
            raise ValueError(f"GATEWAY_DTYPE must be one of {', '.join(GATEWAY_DTYPES)}, got {self.dtype!r}")
        self._check_embedding_names()

    def _check_embedding_names(self) -> None:
        """A name picks one model: two encoders, or an encoder and a chat model, may not share one."""
        taken = {model.name for model in self.models}
        for encoder in self.embedding_models:
            if encoder.name in taken:
                raise ValueError(f"EMBEDDING_MODELS: the name {encoder.name!r} ({encoder.folder}) is already taken "
                                 "by another served model")
            taken.add(encoder.name)

    def serves_discovered(self, name: str) -> bool:
        """Whether a model the swarm announces (not configured here) may be served, if its files are in the
        cache: DISCOVERED_MODELS says."""
        if self.discovered_models in ("none", "cached"):
            return self.discovered_models == "cached"
        return name in _split_list(self.discovered_models)

    @property
    def default_model(self) -> ModelConfig:
        return self.models[0]

    def model(self, name: str | None) -> ModelConfig | None:
        """The served model called `name` (None: the default one)."""
        if name is None:
            return self.default_model
        return next((model for model in self.models if name in (model.name, model.path)), None)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "GatewaySettings":
        if environ.get("MODELS"):
            models = tuple(ModelConfig.from_dict(entry) for entry in json.loads(environ["MODELS"]))
        else:
            name = environ.get("MODEL", DEFAULT_MODEL)
            models = (ModelConfig(name=name.rstrip("/").rsplit("/", 1)[-1], path=name,
                                  revision=environ.get("MODEL_REVISION") or "main",
                                  draft_model=environ.get("DRAFT_MODEL") or None),)
        return cls(models=models, limits=Limits.from_env(environ), access=AccessSettings.from_env(environ),
                   log_level=environ.get("LOG_LEVEL", "INFO").upper(),
                   device=environ.get("GATEWAY_DEVICE") or "cpu", dtype=environ.get("GATEWAY_DTYPE") or "float32",
                   discovered_models=environ.get("DISCOVERED_MODELS") or "none",
                   session_store=_session_store(environ),
                   embedding_models=_embedding_models(environ.get("EMBEDDING_MODELS", "")))


@dataclass(frozen=True)
class Settings:
    swarm: SwarmSettings = field(default_factory=lambda: SwarmSettings.from_env())
    gateway: GatewaySettings = field(default_factory=lambda: GatewaySettings.from_env())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        return cls(swarm=SwarmSettings.from_env(environ), gateway=GatewaySettings.from_env(environ))
