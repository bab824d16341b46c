"""Round trips to the servers routing considers, timed: what a hop costs over a wide-area network, which
swarm/client/routing.py weighs chains by.

A probe is an rpc_info call: it costs a server next to nothing, so its time is the network's. Servers are
probed when routing first sees them, then every PROBE_PERIOD while routing keeps looking at them, the least
recently probed first, PROBES_PER_ROUND at most per period (a swarm of thousands is sampled, not flooded).
A server that does not answer a probe is banned like one that fails a step (swarm/client/peers.py): a server
killed without a word leaves routing within PROBE_PERIOD + PROBE_TIMEOUT, long before its DHT record expires.
Banned servers are not probed (they come back through their records: see SwarmClient.servers).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Collection, Iterable

from swarm.client.peers import Bans, PeerLoad
from swarm.client.stubs import call_info

logger = logging.getLogger(__name__)

PROBE_PERIOD = 5.0  # seconds between two probes of a server routing still considers
PROBE_TIMEOUT = 5.0  # a probe unanswered this long fails: the server is banned
PROBES_PER_ROUND = 64  # servers probed at most per period, the least recently probed first
FORGET_AFTER = 120.0  # a server routing has not considered for this long is probed no more
FIRST_PROBE_WAIT = 1.0  # how long routing waits for the first probes of servers it has not measured


class RoundTripProbes:
    """Times round trips for `load` (PeerLoad.round_trip) on the client's event loop `loop` (dht.EventLoop);
    `consider` and `measure_new` are called from any thread."""

    def __init__(self, p2p, loop, load: PeerLoad, bans: Bans, period: float = PROBE_PERIOD,
                 timeout: float = PROBE_TIMEOUT):
        self.p2p, self.loop, self.load, self.bans = p2p, loop, load, bans
        self.period, self.timeout = period, timeout
        self._considered: dict[str, float] = {}  # peer -> when routing last looked at it
        self._probed: dict[str, float] = {}  # peer -> when its last probe began
        self._lock = threading.Lock()
        self._rounds = None  # the task probing every period, started on first use

    def consider(self, peers: Iterable[str]) -> None:
        """Routing looked at these servers: keep probing them."""
        now = time.monotonic()
        with self._lock:
            for peer in peers:
                self._considered[peer] = now
            if self._rounds is None:
                self._rounds = asyncio.run_coroutine_threadsafe(self._probe_every_period(), self.loop.loop)

    def measure_new(self, peers: Collection[str], wait: float = FIRST_PROBE_WAIT) -> None:
        """Probe the servers never probed yet at once, waiting up to `wait` seconds for their answers (a chain
        chosen meanwhile counts them at the median round trip)."""
        with self._lock:
            new = [peer for peer in peers if peer not in self._probed]
        if not new:
            return
        probes = asyncio.run_coroutine_threadsafe(self._probe_all(new), self.loop.loop)
        try:
            probes.result(wait)
        except Exception:  # still on their way: they finish in the background
            pass

    async def probe(self, peer: str) -> None:
        """One round trip to `peer`, timed; a server that does not answer is banned."""
        with self._lock:
            self._probed[peer] = time.monotonic()
        began = time.perf_counter()
        try:
            await call_info(self.p2p, peer, timeout=self.timeout)
        except Exception as error:  # gone, stalled, or refusing: routing goes elsewhere meanwhile
            logger.info("server %s did not answer a probe (%r): banned for a while", peer, error)
            self.bans.ban(peer)
            return
        self.load.round_trip(peer, time.perf_counter() - began)

    async def _probe_all(self, peers: Iterable[str]) -> None:
        await asyncio.gather(*(self.probe(peer) for peer in peers))

    async def _probe_every_period(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            try:
                await self._probe_all(self._due())
            except Exception:  # never lets the probes stop: a bug here costs one round
                logger.warning("probing servers failed", exc_info=True)

    def _due(self) -> list[str]:
        """The servers routing still considers, not banned, not probed this period; the least recent first."""
        now, banned = time.monotonic(), self.bans.current()
        with self._lock:
            for peer in [peer for peer, seen in self._considered.items() if now - seen > FORGET_AFTER]:
                del self._considered[peer]
                self._probed.pop(peer, None)
            due = [peer for peer in self._considered if peer not in banned
                   and now - self._probed.get(peer, 0.0) >= self.period * 0.9]
        due.sort(key=lambda peer: self._probed.get(peer, 0.0))
        return due[:PROBES_PER_ROUND]

    def close(self) -> None:
        if self._rounds is not None:
            self._rounds.cancel()
