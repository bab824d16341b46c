"""Many connections at once, through a real gunicorn configured as the product configures it (gunicorn.conf.py:
threads sized from the limits) in front of the tiny swarm, with the default limits.

- 1,000 WebSockets open at once (the default MAX_WEBSOCKETS), 64 of them generating: every one is accepted, the
  1,001st is refused with a 429 naming MAX_WEBSOCKETS, /health keeps answering (a generous bound here, as a hang
  detector: the figures are printed with -s), every generating session streams to its end, and /health still
  answers while all 1,000 clients leave at once.
- One client's WebSockets are capped (MAX_WEBSOCKETS_PER_CLIENT): the handshake past the cap is refused with a 429
  and a JSON error before the upgrade, other clients are not held back, and closing one frees its place.

The clients are told apart by X-Forwarded-For (TRUSTED_PROXIES=1), as behind a reverse proxy: 40 clients of 25
sockets each stay under the per-client caps (WebSockets, sessions, requests per minute).
"""

from __future__ import annotations

import asyncio
import json
import re
import resource
import statistics
import threading
import time
from unittest.mock import ANY

import pytest
import requests
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from config import Limits
from gunicorn_gateway import running_gateway
from shared_swarm import TINY_PREFIX

SOCKETS = Limits().max_websockets
PER_CLIENT = Limits().max_websockets_per_client
GENERATING = 64
TOKENS = 32  # per generating session, one frame each
CLIENTS = 40
HANG = 2.0  # seconds: /health slower than this is a hang, not a slow answer
# while a thousand clients leave at once their 2,000 threads wake together and take turns at the GIL: /health's
# worst was 1 to 8 s alone, 17 s in a full run of the suite (before: 17 to 46 s alone, past 30 s in a full run)
HANG_WHILE_ALL_LEAVE = 30.0


@pytest.fixture(scope="module")
def busy_gateway(tiny_swarm, tiny_llama, tmp_path_factory):
    _raise_open_files(SOCKETS + 1024)  # this process holds every client socket
    models = [{"name": "tiny", "path": str(tiny_llama), "dht_prefix": TINY_PREFIX, "max_session_length": 256}]
    env = {"INITIAL_PEERS": " ".join(tiny_swarm.initial_peers), "MODELS": json.dumps(models), "TRUSTED_PROXIES": "1"}
    with running_gateway(env, tmp_path_factory.mktemp("busy-gateway")) as server:
        yield server


def _raise_open_files(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else min(needed, hard),
                                                    hard))


def address(client: int) -> str:
    return f"10.0.{client // 250}.{client % 250 + 1}"


async def open_socket(gateway, client: int):
    return await connect(gateway.ws_url, additional_headers={"X-Forwarded-For": address(client)}, open_timeout=60,
                         ping_interval=None, compression=None, proxy=None)


def gauge(gateway, name: str) -> int:
    text = requests.get(gateway.url + "/metrics", timeout=30).text
    return int(float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1)))


def wait_for_gauge(gateway, name: str, value: int, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while gauge(gateway, name) != value:
        assert time.monotonic() < deadline, f"{name} is {gauge(gateway, name)}, not {value}"
        time.sleep(0.2)


class HealthProbe:
    """GET /health on a fresh connection every 50 ms, as a load balancer would, in a thread of its own."""

    def __init__(self, gateway):
        self.gateway, self.latencies, self.statuses = gateway, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.perf_counter()
            reply = requests.get(self.gateway.url + "/health", timeout=30, headers={"Connection": "close"})
            self.latencies.append(time.perf_counter() - began)
            self.statuses.append(reply.status_code)
            self._stop.wait(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join()


async def generate(ws) -> list[float]:
    """One session's reply, a frame per token: the frames' arrival times."""
    await ws.send(json.dumps({"type": "open_inference_session", "max_length": 128}))
    assert json.loads(await ws.recv()) == {"ok": True, "session_id": ANY}
    await ws.send(json.dumps({"type": "generate", "inputs": "Hello", "stream": True, "max_new_tokens": 1,
                              "max_reply_tokens": TOKENS}))
    arrivals = []
    while True:
        frame = json.loads(await ws.recv())
        assert frame["ok"], frame
        arrivals.append(time.perf_counter())
        if frame["stop"]:
            assert frame["finish_reason"] in ("length", "stop"), frame
            return arrivals


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def summary(name: str, seconds: list[float]) -> str:
    return (f"{name}: median {statistics.median(seconds) * 1000:.1f} ms, p99 {percentile(seconds, 0.99) * 1000:.1f} ms,"
            f" max {max(seconds) * 1000:.1f} ms over {len(seconds)}")


def test_a_thousand_websockets_with_64_generating_and_health_answering(busy_gateway):
    async def scenario():
        began = time.perf_counter()
        sockets = await asyncio.gather(*(open_socket(busy_gateway, index % CLIENTS) for index in range(SOCKETS)))
        opened = time.perf_counter() - began
        try:
            assert await asyncio.to_thread(gauge, busy_gateway, "gateway_open_websockets") == SOCKETS
            with pytest.raises(InvalidStatus) as refused:  # one more than MAX_WEBSOCKETS, from a fresh client
                await open_socket(busy_gateway, CLIENTS)
            assert refused.value.response.status_code == 429
            assert "MAX_WEBSOCKETS" in json.loads(refused.value.response.body)["error"]
            with HealthProbe(busy_gateway) as idle:
                await asyncio.sleep(2)
            with HealthProbe(busy_gateway) as busy:
                replies = await asyncio.gather(*(generate(ws) for ws in sockets[:GENERATING]))
        finally:
            with HealthProbe(busy_gateway) as leaving:
                await asyncio.gather(*(ws.close() for ws in sockets))
        return opened, idle, busy, leaving, replies

    opened, idle, busy, leaving, replies = asyncio.run(scenario())
    gaps = [later - earlier for arrivals in replies for earlier, later in zip(arrivals, arrivals[1:])]
    print(f"\n{SOCKETS} WebSockets opened in {opened:.1f} s; {summary('/health, all idle', idle.latencies)}; "
          f"{summary(f'/health, {GENERATING} generating', busy.latencies)}; "
          f"{summary('per-token latency', gaps)}; {sum(map(len, replies))} tokens; "
          f"{summary('/health, all leaving at once', leaving.latencies)}")
    assert set(idle.statuses + busy.statuses + leaving.statuses) == {200}
    assert max(idle.latencies + busy.latencies) < HANG
    assert max(leaving.latencies) < HANG_WHILE_ALL_LEAVE
    assert len(replies) == GENERATING and all(arrivals for arrivals in replies)
    wait_for_gauge(busy_gateway, "gateway_open_websockets", 0)  # each connection gave its place back
    wait_for_gauge(busy_gateway, "gateway_open_sessions", 0)


def test_one_client_s_websockets_are_capped_before_the_upgrade(busy_gateway):
    async def scenario():
        mine = await asyncio.gather(*(open_socket(busy_gateway, 0) for _ in range(PER_CLIENT)))
        try:
            with pytest.raises(InvalidStatus) as refused:
                await open_socket(busy_gateway, 0)
            other = await open_socket(busy_gateway, 1)  # another client is not held back
            await other.close()
            await mine.pop().close()
            await asyncio.to_thread(wait_for_gauge, busy_gateway, "gateway_open_websockets", PER_CLIENT - 1)
            mine.append(await open_socket(busy_gateway, 0))  # a closed one freed its place
            return refused.value.response
        finally:
            await asyncio.gather(*(ws.close() for ws in mine))

    response = asyncio.run(scenario())
    assert response.status_code == 429 and response.headers["Retry-After"] == "1"
    body = json.loads(response.body)
    assert body["ok"] is False and body["code"] == "too_many_websockets"
    assert "MAX_WEBSOCKETS_PER_CLIENT" in body["error"]
    wait_for_gauge(busy_gateway, "gateway_open_websockets", 0)
