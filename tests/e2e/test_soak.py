"""Soak: 64 WebSocket sessions and 16 streaming OpenAI clients at once against a real gunicorn in front of the
tiny swarm, with random disconnects, for SOAK_SECONDS (default 8 s in the suite; `make soak` runs 300 s).

Every request that was not disconnected on purpose must succeed; afterwards every server's cache use returns
to what it was before, and the processes' memory to within 10% of what it was after a warm-up.
"""

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from unittest.mock import ANY

import openai
import psutil
import pytest
from websockets.asyncio.client import connect

from gunicorn_gateway import Gateway, running_gateway
from shared_swarm import TINY_PREFIX

WS_CLIENTS, OPENAI_CLIENTS = 64, 16
SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "8"))
DISCONNECT_RATE = 0.1  # of requests, cut off midway on purpose
PROMPTS = ["Hello, world!", "The quick brown fox", "A swarm of block servers", "Numbers: 0 1 2", "Привет, мир!"]


@dataclass
class Tally:
    requests: int = 0
    tokens: int = 0
    disconnects: int = 0
    failures: list = field(default_factory=list)


@pytest.fixture(scope="module")
def soak_gateway(tiny_swarm, tiny_llama, tmp_path_factory):
    """A gateway of its own, with room for every client of the soak."""
    models = [{"name": "tiny", "path": str(tiny_llama), "dht_prefix": TINY_PREFIX, "max_session_length": 512}]
    env = {
        "INITIAL_PEERS": " ".join(tiny_swarm.initial_peers),
        "MODELS": json.dumps(models),
        "MAX_SESSIONS": "256",
        "MAX_SESSIONS_PER_CLIENT": "256",  # every client of the soak comes from 127.0.0.1
        "MAX_WEBSOCKETS_PER_CLIENT": "256",
        "REQUESTS_PER_MINUTE": "0",
        "SESSION_IDLE_TIMEOUT": "5",
    }
    with running_gateway(env, tmp_path_factory.mktemp("soak-gateway")) as server:
        yield server


def memory(pids: list[int]) -> int:
    """Resident bytes of these processes and their children."""
    processes = [psutil.Process(pid) for pid in pids]
    processes += [child for process in processes for child in process.children(recursive=True)]
    return sum(process.memory_info().rss for process in processes if process.is_running())


async def websocket_client(url: str, deadline: float, tally: Tally, rng: random.Random) -> None:
    while time.monotonic() < deadline:
        async with connect(url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "open_inference_session", "max_length": 512}))
            assert json.loads(await ws.recv()) == {"ok": True, "session_id": ANY}
            used = 0
            while time.monotonic() < deadline and used < 400:
                count = rng.randint(4, 24)
                await ws.send(json.dumps({"type": "generate", "inputs": rng.choice(PROMPTS), "stream": True,
                                          "max_new_tokens": 1, "max_reply_tokens": count}))  # token by token
                tally.requests += 1
                cut = rng.random() < DISCONNECT_RATE
                while True:
                    frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
                    if not frame.get("ok"):
                        tally.failures.append(frame)
                        return
                    tally.tokens += frame.get("token_count", 0)
                    if cut:  # mid-reply: drop the connection without a goodbye
                        tally.disconnects += 1
                        ws.transport.abort()
                        break
                    if frame.get("stop"):
                        break
                if cut:
                    break
                used += count + 8


async def openai_client(base_url: str, deadline: float, tally: Tally, rng: random.Random) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=60)
    while time.monotonic() < deadline:
        tally.requests += 1
        cut = rng.random() < DISCONNECT_RATE
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": rng.choice(PROMPTS)}],
            max_tokens=rng.randint(4, 24), stream=True,
        )
        async for chunk in stream:
            tally.tokens += sum(1 for choice in chunk.choices if choice.delta.content)
            if cut:
                tally.disconnects += 1
                await stream.close()  # closes the HTTP connection mid-stream
                break
    await client.close()


async def soak(gateway: Gateway, seconds: float, seed: int) -> Tally:
    tally, deadline = Tally(), time.monotonic() + seconds

    async def guarded(coroutine):
        try:
            await coroutine
        except Exception as error:  # anything but a deliberate cut is a failed request
            tally.failures.append(repr(error))

    rng = random.Random(seed)
    clients = [websocket_client(gateway.ws_url, deadline, tally, random.Random(rng.random())) for _ in range(WS_CLIENTS)]
    clients += [openai_client(gateway.url + "/v1", deadline, tally, random.Random(rng.random()))
                for _ in range(OPENAI_CLIENTS)]
    await asyncio.gather(*(guarded(client) for client in clients))
    return tally


def cache_free(tiny_remote) -> dict:
    """Each server's free cache, counting what the gateway's parked conversations hold (see leak_checks.py)."""
    infos = {server.peer_id: tiny_remote.client.server_info(server.peer_id)
             for server in tiny_remote.client.servers(TINY_PREFIX, tiny_remote.num_blocks)}
    return {peer: info["cache_tokens_free"] + info.get("parked_tokens", 0) for peer, info in infos.items()}


def test_soak(soak_gateway, tiny_swarm, tiny_remote, capsys):
    # servers other tests of this worker added to the swarm and stopped again stay listed: only the live ones
    servers = [server.process.pid for server in tiny_swarm.servers if server.process.poll() is None]
    pids = [soak_gateway.process.pid, *servers]
    free_before = cache_free(tiny_remote)
    warm_up = asyncio.run(soak(soak_gateway, min(10.0, SOAK_SECONDS / 4), seed=1))  # threads, arenas, caches
    assert not warm_up.failures, warm_up.failures[:5]
    time.sleep(2)
    memory_before = memory(pids)

    tally = asyncio.run(soak(soak_gateway, SOAK_SECONDS, seed=2))

    deadline = time.monotonic() + 30  # cut-off clients' sessions close once the gateway notices they are gone
    while (free_after := cache_free(tiny_remote)) != free_before and time.monotonic() < deadline:
        time.sleep(0.5)
    memory_after = memory(pids)
    with capsys.disabled():
        print(f"\nsoak {SOAK_SECONDS:.0f} s, {WS_CLIENTS} WebSocket + {OPENAI_CLIENTS} OpenAI clients: "
              f"{tally.requests} requests, {tally.tokens} tokens, {tally.disconnects} cut off on purpose, "
              f"{len(tally.failures)} failed; memory {memory_before / 2**20:.0f} MiB -> {memory_after / 2**20:.0f} MiB")
    assert not tally.failures, tally.failures[:5]
    assert tally.requests > WS_CLIENTS + OPENAI_CLIENTS and tally.disconnects > 0
    assert free_after == free_before  # every session's cache was given back on every server
    assert memory_after < 1.1 * memory_before
    assert soak_gateway.process.poll() is None and "Traceback" not in soak_gateway.log()
