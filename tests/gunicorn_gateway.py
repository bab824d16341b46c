"""The one way a test runs a real gateway: `running_gateway`, gunicorn serving app:app on a free port, stopped
when the block ends, its log then checked (tests/gateway_log.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import requests

from gateway_log import assert_clean_log
from processes import ROOT, free_port, stop_process


class Gateway:
    """A real gunicorn process serving app:app on a free port, healthy once constructed (see running_gateway)."""

    def __init__(self, env: dict, log_path: Path, port: int | None = None, host: str = "127.0.0.1"):
        """`host`: where it listens (0.0.0.0: every address, loopback included, which the tests use)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/api/v2/generate"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        # each gateway its own session store, beside its log, unless the test shares one on purpose
        env = {"SESSION_STORE": str(log_path.parent / "sessions.sqlite3"), **env}
        # the product's gunicorn.conf.py (read from ROOT) decides the worker: threads sized from the limits in `env`
        command = [sys.executable, "-m", "gunicorn", "app:app", "--bind", f"{host}:{self.port}"]
        self.process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **env}, stdout=self._log,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._log.close()
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

    def kill(self) -> None:
        """SIGKILL to the worker and the master at once, as a crash or an OOM kill would: nothing is cleaned up."""
        import psutil

        workers = psutil.Process(self.process.pid).children(recursive=True)
        self.process.kill()  # the master first, so that it starts no worker in place of one killed
        for worker in workers:
            worker.kill()
        self.process.wait(20)
        self._log.close()

    def stop(self) -> None:
        stop_process(self.process)
        self._log.close()


@contextmanager
def running_gateway(env: dict, log_dir: Path, expected_errors: Sequence[str] = (), host: str = "127.0.0.1"
                    ) -> Iterator[Gateway]:
    """gunicorn serving app:app with `env` over this process's environment, healthy when the block begins and
    stopped when it ends; then its log (log_dir/gunicorn.log) must hold no error and no traceback
    (tests/gateway_log.py) but those its tests cause on purpose: `expected_errors`, regular expressions of
    ERROR lines, each of which must appear."""
    server = Gateway(env, log_dir / "gunicorn.log", host=host)
    try:
        yield server
    finally:
        server.stop()
    assert_clean_log(server.log(), expected_errors)


def add_other_model(swarm, folder: Path, prefix: str, blocks: str, wait: bool = True):
    """A block server of another model than the tiny one in the shared tiny swarm, under its own DHT prefix; with
    `--adapters` alone, none of the tiny model's LoRA adapters that the swarm's server arguments name."""
    return swarm.add_server(["--model", str(folder), "--blocks", blocks, "--dht-prefix", prefix, "--adapters"],
                            wait=wait)


@contextmanager
def gateway_of_another_model(swarm, name: str, folder: Path, prefix: str, blocks: str, log_dir: Path,
                             **model_fields) -> Iterator[Gateway]:
    """A server of another model in the shared tiny swarm (add_other_model) and a gunicorn gateway serving that
    model as `name`; the server stops with the gateway."""
    server = add_other_model(swarm, folder, prefix, blocks)
    models = [{"name": name, "path": str(folder), "dht_prefix": prefix, **model_fields}]
    try:
        with running_gateway({"INITIAL_PEERS": " ".join(swarm.initial_peers), "MODELS": json.dumps(models)},
                             log_dir) as gateway:
            yield gateway
    finally:
        server.stop()
