"""A real gateway for the benchmarks: gunicorn serving app:app, as in production, in front of a given swarm.

It runs as a swarm.local.ChildProcess, so it is stopped like the block servers (SIGTERM, then SIGKILL) and
dies with this process even if this one is killed.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Sequence

import requests

from bench.workload import MODEL
from config import Limits
from swarm.local import ChildProcess, LocalSwarmError

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT = 120.0
GUNICORN_THREADS = 100  # gunicorn.conf.py's: each WebSocket connection holds one thread while it lasts


def bench_limits(max_sessions: int) -> dict[str, str]:
    """The gateway's caps (config.Limits) lifted so that `max_sessions` simultaneous sessions, all from 127.0.0.1
    and each over a WebSocket of its own, are all served: the caps per process and per client on sessions and
    on WebSockets, and the rate limit, which counts every WebSocket message. The others do not bind here: a
    session's new tokens (MAX_NEW_TOKENS) and messages (WS_MAX_MESSAGE_BYTES) are small, and warm conversations
    (WARM_SESSIONS) are parked outside the session caps. The servers' own per-peer cap is suite.server_limits'."""
    return {
        "MAX_SESSIONS": str(max_sessions),
        "MAX_SESSIONS_PER_CLIENT": str(max_sessions),
        "MAX_WEBSOCKETS": str(max(max_sessions, Limits.max_websockets)),
        "MAX_WEBSOCKETS_PER_CLIENT": str(max_sessions),
        "REQUESTS_PER_MINUTE": "0",
    }


class Gateway:
    """`with Gateway(swarm.initial_peers, ...) as gateway: gateway.ws_url ...`; it serves `model` (a known name
    or a folder) and runs its embeddings and LM head on `device` in `dtype`."""

    def __init__(self, initial_peers: Sequence[str], max_sessions: int, torch_threads: int, log_dir: Path,
                 model: str = MODEL, device: str = "cpu", dtype: str = "float32", env: dict | None = None,
                 app: str = "app:app"):
        """`app`: what gunicorn serves (bench.instant_swarm:app: the gateway over a swarm that answers at once)."""
        self.port, self.app = free_port(), app
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/api/v2/generate"
        self.openai_url = f"{self.url}/v1"
        self.env = {
            "INITIAL_PEERS": " ".join(initial_peers),
            **bench_limits(max_sessions),
            "TORCH_THREADS": str(torch_threads),
            "MODEL": model,
            "GATEWAY_DEVICE": device,
            "GATEWAY_DTYPE": dtype,
            **(env or {}),  # any other setting
        }
        self.threads = max(GUNICORN_THREADS, max_sessions + 8)  # + a few for /health and /metrics
        self.log_dir = log_dir
        self.process: ChildProcess | None = None

    def start(self) -> "Gateway":
        return self.launch().wait_healthy()

    def launch(self) -> "Gateway":
        """Start the gateway's process without waiting for it (several start side by side); then wait_healthy."""
        command = ["-m", "gunicorn", "--config", str(ROOT / "gunicorn.conf.py"), "--chdir", str(ROOT),
                   "--bind", f"127.0.0.1:{self.port}", "--threads", str(self.threads), self.app]
        self.process = ChildProcess("gateway", command, self.log_dir, {**os.environ, **self.env})
        return self

    def wait_healthy(self) -> "Gateway":
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        """/health is 200 once the gateway has joined the swarm and sees every block of the model covered."""
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.process.poll() is not None:
                raise LocalSwarmError(f"the gateway exited; log: {self.process.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=30).status_code == 200:
                    return
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or still busy starting
                pass
            time.sleep(0.3)
        raise LocalSwarmError(f"the gateway was not healthy after {READY_TIMEOUT:.0f} s; log: {self.process.log_tail()}")

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the gateway has closed every session (and so freed the servers' caches), at most `timeout` s:
        the next measurement then starts on empty caches."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            metrics = requests.get(self.url + "/metrics", timeout=10).text
            match = re.search(r"^gateway_open_sessions (\S+)$", metrics, re.MULTILINE)
            if match is None or float(match.group(1)) == 0:
                return
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is None:
            return
        # gunicorn's quick shutdown: on SIGTERM it would wait up to its graceful_timeout for the WebSocket
        # sessions still open after a Ctrl-C or an error, and the benchmark wants none of them any more
        if self.process.process.poll() is None:
            self.process.process.send_signal(signal.SIGQUIT)
            try:
                self.process.process.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.process.stop()  # SIGTERM and SIGKILL if it is still there; closes the log

    def __enter__(self) -> "Gateway":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
