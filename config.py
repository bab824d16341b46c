"""Settings of every process in this repository, and the only module that reads os.environ.

Each command-line tool takes its defaults from here, so an operator can set them once in the environment:

    SWARM_CACHE_DIR   where converted models live (default: $XDG_CACHE_HOME/swarm-gateway or ~/.cache/...)
    INITIAL_PEERS     space- or comma-separated multiaddrs of DHT peers to join
    WIRE_DTYPE        how a client sends hidden states to servers: float32 (default, exact), bfloat16 or float16
    ALLOWED_SERVERS   a private swarm's servers (peer ids, space- or comma-separated): clients route only to them
    ALLOWED_CLIENTS   the only peers a block server serves (default: anyone); ALLOWED_SERVERS may push to it too
    SPOT_CHECK_RATE   the chance (0..1, default 0: off) that a client re-checks a step's outputs on another server
    MODEL             the model served by default (a known name or a local Hugging Face folder)
    MODELS            the gateway's served models, as a JSON list of ModelConfig fields, e.g.
                      [{"name": "tiny", "path": "/models/tiny", "dht_prefix": "tiny", "max_session_length": 512}]
    MAX_SESSIONS, SESSION_IDLE_TIMEOUT, MAX_NEW_TOKENS, WS_PING_INTERVAL, WS_MAX_MESSAGE_BYTES
                      the gateway's limits (see Limits)
    API_KEYS, API_KEY_FILE, ALLOWED_ORIGINS, ALLOWED_METHODS, ALLOWED_HEADERS, ALLOW_CREDENTIALS
                      who may call the APIs (see AccessSettings)
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
WIRE_DTYPES = ("float32", "bfloat16", "float16")


def _split_list(value: str) -> tuple[str, ...]:
    return tuple(item for item in re.split(r"[\s,]+", value) if item)


def _default_cache_dir(environ: Mapping[str, str]) -> Path:
    if environ.get("SWARM_CACHE_DIR"):
        return Path(environ["SWARM_CACHE_DIR"]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "swarm-gateway"


@dataclass(frozen=True)
class SwarmSettings:
    """What a block server, a bootstrap peer or a swarm client needs to know before it starts."""

    cache_dir: Path
    model: str = DEFAULT_MODEL
    initial_peers: tuple[str, ...] = ()
    # A block server re-announces itself this often; its records expire after three periods,
    # so a server that died silently leaves routing within 3 * announce_period seconds.
    announce_period: float = 10.0
    cache_tokens: int = 32768
    wire_dtype: str = "float32"
    allowed_servers: tuple[str, ...] = ()  # empty: any server
    allowed_clients: tuple[str, ...] = ()  # empty: any client
    spot_check_rate: float = 0.0

    def __post_init__(self):
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"WIRE_DTYPE must be one of {', '.join(WIRE_DTYPES)}, got {self.wire_dtype!r}")
        if not 0.0 <= self.spot_check_rate <= 1.0:
            raise ValueError(f"SPOT_CHECK_RATE must be between 0 and 1, got {self.spot_check_rate}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "SwarmSettings":
        return cls(
            cache_dir=_default_cache_dir(environ),
            model=environ.get("MODEL", DEFAULT_MODEL),
            initial_peers=_split_list(environ.get("INITIAL_PEERS", "")),
            wire_dtype=environ.get("WIRE_DTYPE", "float32"),
            allowed_servers=_split_list(environ.get("ALLOWED_SERVERS", "")),
            allowed_clients=_split_list(environ.get("ALLOWED_CLIENTS", "")),
            spot_check_rate=float(environ.get("SPOT_CHECK_RATE") or 0.0),
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
    path: str  # a known model name or a local Hugging Face folder
    dht_prefix: str | None = None  # its name in the DHT; by default derived from path
    max_session_length: int = 2048
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)

    @classmethod
    def from_dict(cls, fields: dict) -> "ModelConfig":
        fields = dict(fields)
        fields.setdefault("path", fields.get("name"))
        defaults = GenerationDefaults(**fields.pop("defaults", {}))
        return cls(defaults=defaults, **fields)


@dataclass(frozen=True)
class Limits:
    max_sessions: int = 256  # open inference sessions per gateway process, HTTP and WebSocket together
    session_idle_timeout: float = 600.0  # seconds; an idle HTTP session is then closed on the servers too
    max_new_tokens: int = 4096  # the most one request may ask for
    ws_ping_interval: float = 25.0  # keep-alive pings on WebSocket connections, seconds
    ws_max_message_bytes: int = 1 << 20


@dataclass(frozen=True)
class AccessSettings:
    """Who may call the APIs: API keys (none configured: open) and the CORS allowlists (MLC's server flags)."""

    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "AccessSettings":
        keys = list(_split_list(environ.get("API_KEYS", "")))
        if environ.get("API_KEY_FILE"):
            keys += Path(environ["API_KEY_FILE"]).expanduser().read_text().split()
        lists = {name: _split_list(environ[name.upper()]) for name in ("allowed_origins", "allowed_methods",
                                                                      "allowed_headers") if environ.get(name.upper())}
        credentials = environ.get("ALLOW_CREDENTIALS", "").lower() in ("1", "true", "yes")
        return cls(api_keys=tuple(keys), allow_credentials=credentials, **lists)


@dataclass(frozen=True)
class GatewaySettings:
    models: tuple[ModelConfig, ...]
    limits: Limits = field(default_factory=Limits)
    access: AccessSettings = field(default_factory=AccessSettings)

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
            models = (ModelConfig(name=name.rstrip("/").rsplit("/", 1)[-1], path=name),)
        limits = Limits(
            **{
                key: type(getattr(Limits, key))(environ[key.upper()])
                for key in Limits.__dataclass_fields__
                if environ.get(key.upper())
            }
        )
        return cls(models=models, limits=limits, access=AccessSettings.from_env(environ))


@dataclass(frozen=True)
class Settings:
    swarm: SwarmSettings = field(default_factory=lambda: SwarmSettings.from_env())
    gateway: GatewaySettings = field(default_factory=lambda: GatewaySettings.from_env())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        return cls(swarm=SwarmSettings.from_env(environ), gateway=GatewaySettings.from_env(environ))
