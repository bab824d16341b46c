"""Shared fixtures: tiny random-weight models built from a config, and real localhost swarms serving them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_model import build_tiny_model  # noqa: E402

TINY_BLOCKS = 4
TINY_PREFIX = "tiny"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", TINY_BLOCKS)


@pytest.fixture(scope="session")
def settings():
    from config import SwarmSettings

    return SwarmSettings.from_env()


@pytest.fixture(scope="session")
def tiny_swarm(tiny_llama, tmp_path_factory):
    """A bootstrap peer and two block servers (blocks 0:2 and 2:4 of the tiny Llama) as real processes."""
    from swarm.local import LocalSwarm

    swarm = LocalSwarm(
        str(tiny_llama), [(0, 2), (2, 4)], server_args=["--dht-prefix", TINY_PREFIX],
        log_dir=tmp_path_factory.mktemp("swarm-logs"),
    )
    with swarm:
        yield swarm


@pytest.fixture(scope="session")
def tiny_remote(tiny_swarm, tiny_llama, settings):
    from swarm.model import RemoteModel

    model = RemoteModel.from_pretrained(str(tiny_llama), tiny_swarm.initial_peers, settings.cache_dir, TINY_PREFIX)
    yield model
    model.close()


@pytest.fixture(scope="session")
def real_model(settings) -> Path:
    """The default model's converted folder (converted on first use: `make test` has done it already)."""
    from swarm.weights import resolve_model

    return resolve_model("SmolLM2-135M-Instruct", settings.cache_dir)


def run_tool(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run one of the project's command-line tools the way a user would."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
