"""Settings of every process in this repository, and the only module that reads os.environ.

Each command-line tool takes its defaults from here, so an operator can set them once in the environment:

    SWARM_CACHE_DIR   where converted models live (default: $XDG_CACHE_HOME/swarm-gateway or ~/.cache/...)
    INITIAL_PEERS     space- or comma-separated multiaddrs of DHT peers to join
    MODEL             the model served by default (a known name or a local Hugging Face folder)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "SwarmSettings":
        return cls(
            cache_dir=_default_cache_dir(environ),
            model=environ.get("MODEL", DEFAULT_MODEL),
            initial_peers=_split_list(environ.get("INITIAL_PEERS", "")),
        )


@dataclass(frozen=True)
class Settings:
    swarm: SwarmSettings = field(default_factory=lambda: SwarmSettings.from_env())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        return cls(swarm=SwarmSettings.from_env(environ))
