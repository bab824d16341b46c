"""Shared fixtures: tiny random-weight models built from a config, and real localhost swarms serving them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Two xdist workers share 2 cores, each with servers and gateways of its own: a second compute thread per process
# only spins waiting for a core (a fifth more CPU for the same work, measured). Every process of the suite, its
# children included, computes on one thread; an explicit OMP_NUM_THREADS still wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_log import assert_clean_log  # noqa: E402
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
        _shared_swarms.append(swarm)
        yield swarm


_shared_swarms: list = []  # the tiny swarm, once some test of this worker has started it


@pytest.fixture(scope="module", autouse=True)
def servers_a_module_adds_stop_with_it():
    """The servers a module adds to the shared tiny swarm stop when the module ends: an idle server still
    announces itself and keeps its libp2p daemon busy (about 1% of a core each, with its daemon: measured), and
    a worker runs dozens of modules. The swarm's own servers stay."""
    before = {id(swarm): len(swarm.servers) for swarm in _shared_swarms}
    yield
    for swarm in _shared_swarms:
        for server in swarm.servers[max(before.get(id(swarm), 0), len(swarm.spans)):]:
            server.stop()


@pytest.fixture(scope="session")
def tiny_remote(tiny_swarm, tiny_llama, settings):
    from swarm.client.remote_model import RemoteModel

    model = RemoteModel.from_pretrained(str(tiny_llama), tiny_swarm.initial_peers, settings.cache_dir, TINY_PREFIX)
    yield model
    model.close()


@pytest.fixture(scope="module")
def client(tiny_swarm):
    """A swarm client of the tiny swarm (a DHT node of its own) for one test module."""
    from swarm.client import SwarmClient

    client = SwarmClient(tiny_swarm.initial_peers)
    yield client
    client.shutdown()


@pytest.fixture(scope="session")
def real_model(settings) -> Path:
    """The default model's converted folder (converted on first use: `make test` has done it already)."""
    from swarm.weights import resolve_model

    return resolve_model("SmolLM2-135M-Instruct", settings.cache_dir)


@pytest.fixture(scope="session")
def real_swarm(real_model, tmp_path_factory):
    """The default model on two real block servers: blocks 0:15 and 15:30."""
    from swarm.local import LocalSwarm

    with LocalSwarm("SmolLM2-135M-Instruct", [(0, 15), (15, 30)], log_dir=tmp_path_factory.mktemp("real-logs")) as swarm:
        yield swarm


def run_tool(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run one of the project's command-line tools the way a user would (`env`: extra environment variables)."""
    import os

    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Gateway:
    """A real gunicorn process serving app:app on a free port."""

    def __init__(self, env: dict, log_path: Path):
        import os
        import time

        import requests

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/api/v2/generate"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        # the product's gunicorn.conf.py (read from ROOT) decides the worker: threads sized from the limits in `env`
        command = [sys.executable, "-m", "gunicorn", "app:app", "--bind", f"127.0.0.1:{self.port}"]
        self.process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **env}, stdout=self._log,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gunicorn exited: {self.log_path.read_text()[-3000:]}")
            try:
                if requests.get(self.url + "/health", timeout=30).status_code == 200:
                    return
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or a worker still loading
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"gunicorn not healthy in time: {self.log_path.read_text()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


TINY_MAX_SESSIONS = 6
TINY_MAX_SESSION_LENGTH = 1024  # the tiny tokenizer spends a token on nearly every character
TINY_IDLE_TIMEOUT = 3.0


@pytest.fixture(scope="session")
def gateway(tiny_swarm, tiny_llama, tmp_path_factory):
    """gunicorn in front of the tiny swarm, with a small cap on sessions and a short idle timeout."""
    import json

    models = [{"name": "tiny", "path": str(tiny_llama), "dht_prefix": TINY_PREFIX, "max_session_length": TINY_MAX_SESSION_LENGTH}]
    env = {
        "INITIAL_PEERS": " ".join(tiny_swarm.initial_peers),
        "MODELS": json.dumps(models),
        "MAX_SESSIONS": str(TINY_MAX_SESSIONS),
        "SESSION_IDLE_TIMEOUT": str(TINY_IDLE_TIMEOUT),
        "MAX_NEW_TOKENS": "200",
        "WS_PING_INTERVAL": "1",
    }
    server = Gateway(env, tmp_path_factory.mktemp("gateway") / "gunicorn.log")
    yield server
    server.stop()
    assert_clean_log(server.log())  # no error, no traceback: see tests/gateway_log.py


STRICT_KEYS = ("key-access", "key-body", "key-context", "key-sessions", "key-other", "key-rate", "key-ws-rate",
               "key-ws", "key-logs", "key-browser", "key-anthropic", "key-ollama")  # one per test: the per-client limits count by key
STRICT_ORIGIN = "https://chat.example"
STRICT_CONTEXT = 64  # the model's max_session_length
STRICT_LIMITS = {"MAX_SESSIONS_PER_CLIENT": 2, "REQUESTS_PER_MINUTE": 40, "WS_IDLE_TIMEOUT": 3, "MAX_BODY_BYTES": 8192,
                 "WS_MAX_MESSAGE_BYTES": 4096, "MAX_NEW_TOKENS": 16}


@pytest.fixture(scope="session")
def strict_gateway(tiny_swarm, tiny_llama, tmp_path_factory):
    """gunicorn in front of the tiny swarm configured tight: API keys, an origin allowlist, small limits."""
    import json

    models = [{"name": "tiny", "path": str(tiny_llama), "dht_prefix": TINY_PREFIX, "max_session_length": STRICT_CONTEXT}]
    env = {"INITIAL_PEERS": " ".join(tiny_swarm.initial_peers), "MODELS": json.dumps(models),
           "API_KEYS": ",".join(STRICT_KEYS), "ALLOWED_ORIGINS": STRICT_ORIGIN, "LOG_LEVEL": "INFO",
           **{name: str(value) for name, value in STRICT_LIMITS.items()}}
    server = Gateway(env, tmp_path_factory.mktemp("strict-gateway") / "gunicorn.log")
    yield server
    server.stop()
    assert_clean_log(server.log())
