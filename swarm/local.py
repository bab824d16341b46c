"""A small swarm on this machine: a bootstrap peer and block servers as child processes.

Used by `python app.py` when no initial peers are configured, by the tests' fixtures and by the benchmarks.
Every process is started the way an operator would start it (`python -m swarm.dht`, `python -m swarm.server`),
waited on until it says it is ready, and stopped (SIGTERM, then SIGKILL) when the swarm stops.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

READY_TIMEOUT = 180.0


class LocalSwarmError(RuntimeError):
    pass


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if its parent dies, even by SIGKILL, so no server outlives its swarm.

    The kernel ties this to the thread that started the child: start a LocalSwarm from a long-lived thread.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ChildProcess:
    """A child whose stdout lines are read by a thread (so the pipe never fills) and whose stderr goes to a log."""

    def __init__(self, name: str, args: Sequence[str], log_dir: Path, env: Optional[dict] = None,
                 prefix: Sequence[str] = ()):
        """`prefix`: a command that runs the Python process (e.g. `ip netns exec NAME` for a network namespace)."""
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [*prefix, sys.executable, *args], stdout=subprocess.PIPE, stderr=self._log, env=env, text=True, bufsize=1,
            start_new_session=True,  # a Ctrl-C in the terminal reaches the parent, which stops us in order
            preexec_fn=_die_with_parent,
        )
        self._lines: queue.Queue = queue.Queue()
        self.ready_line: Optional[str] = None  # a block server's "ready: ... as peer ID, ..." line
        threading.Thread(target=self._read_stdout, daemon=True).start()

    @property
    def peer_id(self) -> Optional[str]:
        match = re.search(r" as peer (\S+),", self.ready_line or "")
        return match.group(1) if match else None

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_for_line(self, predicate, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise LocalSwarmError(f"{self.name} was not ready after {timeout:.0f} s; log: {self.log_tail()}")
            if line is None:
                raise LocalSwarmError(f"{self.name} exited with {self.process.wait()}; log: {self.log_tail()}")
            if predicate(line):
                return line

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> None:
        self.terminate()
        if self.process.poll() is None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


class LocalSwarm:
    """`with LocalSwarm(model, [(0, 15), (15, 30)]) as swarm: swarm.initial_peers ...`"""

    def __init__(
        self,
        model: str,
        spans: Sequence[tuple[int, int]],
        server_args: Sequence[str] = (),
        env: Optional[dict] = None,
        log_dir: Optional[Path] = None,
    ):
        self.model, self.spans, self.server_args = model, list(spans), list(server_args)
        self.env = {**os.environ, **(env or {})}
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="local-swarm-"))
        self.initial_peers: list[str] = []
        self.servers: list[ChildProcess] = []
        self.bootstrap: Optional[ChildProcess] = None

    def start(self) -> "LocalSwarm":
        try:
            self.bootstrap = ChildProcess("dht", ["-m", "swarm.dht"], self.log_dir, self.env)
            self.initial_peers = self.bootstrap.wait_for_line(lambda line: "/p2p/" in line, READY_TIMEOUT).split()
            for start, end in self.spans:
                self.add_server(["--blocks", f"{start}:{end}"], wait=False)
            for server in self.servers:
                server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), READY_TIMEOUT)
        except BaseException:
            self.stop()
            raise
        return self

    def add_server(self, args: Sequence[str], wait: bool = True) -> ChildProcess:
        """Start one more block server with these arguments (plus the swarm's model and peers)."""
        name = f"server{len(self.servers)}"
        command = ["-m", "swarm.server", "--model", self.model, *self.server_args, *args]  # args override
        server = ChildProcess(name, [*command, "--initial-peers", *self.initial_peers], self.log_dir, self.env)
        self.servers.append(server)
        if wait:
            server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), READY_TIMEOUT)
        return server

    def stop(self) -> None:
        for server in self.servers:  # all at once: each withdraws its records while the DHT is still up
            server.terminate()
        for child in [*self.servers, self.bootstrap]:
            if child is not None:
                child.stop()

    def __enter__(self) -> "LocalSwarm":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def latency_args(round_trip_ms: float, jitter_ms: float = 0.0, seed: int = 0) -> list[str]:
    """A block server's flags adding a simulated network round trip (swarm/server/latency.py), for LocalSwarm's
    server_args or add_server. A gateway's own local swarm follows SIMULATED_LATENCY_MS instead (config)."""
    return ["--simulated-latency", f"{round_trip_ms:g}", "--simulated-latency-jitter", f"{jitter_ms:g}",
            "--simulated-latency-seed", str(seed)]


def network_map_args(network_map: str, region: str) -> list[str]:
    """A block server's flags placing it in `region` of a simulated network map (JSON, or a file's path: see
    swarm/network_map.py), for LocalSwarm's server_args or add_server."""
    return ["--network-map", network_map, "--region", region]


def halves(num_blocks: int) -> list[tuple[int, int]]:
    """Two servers splitting the blocks, as a small swarm on one machine would."""
    middle = num_blocks // 2
    return [(0, middle), (middle, num_blocks)] if middle else [(0, num_blocks)]


def start_for_models(settings) -> LocalSwarm:
    """A local swarm serving every model the gateway serves (config.Settings), two servers per model."""
    from swarm.weights import load_config, resolve_model

    swarm = None
    try:
        for model in settings.gateway.models:
            num_blocks = load_config(resolve_model(model.path, settings.swarm.cache_dir,
                                                   model.revision)).num_hidden_layers
            # its own revision, whatever MODEL_REVISION the servers inherit says (it is the default model's)
            server_args = ["--revision", model.revision, *(["--dht-prefix", model.dht_prefix] if model.dht_prefix
                                                          else [])]
            if swarm is None:
                swarm = LocalSwarm(model.path, halves(num_blocks), server_args=server_args).start()
                continue
            for start, end in halves(num_blocks):
                swarm.add_server(["--model", model.path, "--blocks", f"{start}:{end}", *server_args])
    except BaseException:
        if swarm is not None:
            swarm.stop()
        raise
    return swarm
