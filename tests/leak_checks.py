"""What a gateway holds, read from outside: its open inference sessions (gateway_open_sessions on /metrics) and
every block server's free attention cache (rpc_info's cache_tokens_free, asked of each server directly, since the
DHT's records lag by an announce period). `Holdings.assert_back()` waits until both are back where they started.

Cache that sessions parked by the gateway hold (finished conversations kept warm for reuse: gateway/engine/warm.py)
counts as free: any session that needs it gets it (the server evicts parked sessions first), and the gateway
bounds how many it keeps (WARM_SESSIONS). A request that leaks leaves a session open and unparked.

    holdings = Holdings(gateway, tiny_remote.client, tiny_swarm)   # takes the starting point
    ... requests ...
    holdings.assert_back()
"""

from __future__ import annotations

import re
import time

import requests

SETTLE_SECONDS = 15.0  # a closed session frees the servers' cache when its stream's close reaches them


class Holdings:
    def __init__(self, gateway, client, swarm, headers: dict | None = None):
        """`client`: a swarm.client.SwarmClient of the test's own; `swarm`: the LocalSwarm whose servers to read."""
        self.gateway, self.client, self.swarm, self.headers = gateway, client, swarm, headers or {}
        self.started_sessions, self.started_cache = self.wait_until_settled()

    def open_sessions(self) -> int:
        text = requests.get(self.gateway.url + "/metrics", headers=self.headers, timeout=30).text
        return int(float(re.search(r"^gateway_open_sessions (\S+)$", text, re.MULTILINE).group(1)))

    def free_cache(self) -> dict[str, int]:
        """Each running server's free cache slots (those of parked sessions too), by peer id."""
        return {server.peer_id: free_cache(self.client, server)
                for server in self.swarm.servers if server.process.poll() is None and server.peer_id}

    def wait_until_settled(self, seconds: float = SETTLE_SECONDS) -> tuple[int, dict[str, int]]:
        """(open sessions, free cache) once neither changes between two reads: the starting point."""
        deadline, last = time.monotonic() + seconds, None
        while True:
            now = (self.open_sessions(), self.free_cache())
            if now == last or time.monotonic() > deadline:
                return now
            last = now
            time.sleep(0.3)

    def assert_back(self, after: str = "", seconds: float = SETTLE_SECONDS) -> None:
        """Open sessions and every server's free cache are back where they started (a session of another test
        that ended meanwhile only raises the starting point)."""
        deadline = time.monotonic() + seconds
        while True:
            sessions, cache = self.open_sessions(), self.free_cache()
            self.started_cache = {peer: max(free, self.started_cache.get(peer, free)) for peer, free in cache.items()}
            self.started_sessions = min(sessions, self.started_sessions)
            if sessions == self.started_sessions and cache == self.started_cache:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"held after {after or 'the requests'}: {sessions} open sessions (started with "
                                     f"{self.started_sessions}), free cache {cache} (started with {self.started_cache})")
            time.sleep(0.05)


def free_cache(client, server) -> int:
    """One server's free cache slots, those of parked sessions included (`server`: a swarm.local.ChildProcess),
    asked of it directly."""
    info = client.server_info(server.peer_id)
    return info["cache_tokens_free"] + info.get("parked_tokens", 0)


def wait_for_free_cache(client, server, tokens: int, timeout: float = 60) -> None:
    """Until the server's free cache is `tokens`: a closed session's pages come back when the close reaches it."""
    deadline = time.monotonic() + timeout
    while free_cache(client, server) != tokens:
        assert time.monotonic() < deadline, f"the server's free cache never came back to {tokens}"
        time.sleep(0.2)
