"""Round trips to the servers routing considers, timed: what a hop costs over a wide-area network, which
swarm/client/routing.py weighs chains by.

A probe is an rpc_info call: it costs a server next to nothing, so its time is the network's. Servers are
probed when routing first sees them, then every PROBE_PERIOD while routing keeps looking at them, the least
recently probed first, PROBES_PER_ROUND at most per period (a swarm of thousands is sampled, not flooded).
First probes (of servers never probed) are bounded apart: any peer may publish records under fresh identities,
as many as it likes, so at most FIRST_PROBES_AT_ONCE run at once and FIRST_PROBES_PER_PERIOD begin per period,
picked by chance among the new servers (a flood of them does not keep the others out for long); the rest wait
for a later call or round. Routing waits for first probes only while it has measured none of its candidates.
A server that does not answer a probe is banned like one that fails a step (swarm/client/peers.py), and found
dead: routing leaves it out, even where only it holds some blocks, until it announces anew (DeadPeers). A server
killed without a word leaves routing within PROBE_PERIOD + PROBE_TIMEOUT, long before its DHT record expires, and
at once where a session's step there fails: every ban but a probe's is checked by a probe at once (`confirm`).
Banned servers are not probed, but for the one probe a restart may earn them (see `retry`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from typing import Collection, Iterable, Optional

from swarm.client.peers import Bans, DeadPeers, PeerLoad
from swarm.client.stubs import call_info
from swarm.protocol import SwarmError

logger = logging.getLogger(__name__)

PROBE_PERIOD = 5.0  # seconds between two probes of a server routing still considers
PROBE_TIMEOUT = 5.0  # a probe unanswered this long fails: the server is banned
# servers probed again at most per period, the least recently probed first; and first probes (of servers never
# probed) in flight at most, and begun per period at most. At 1,000 servers a gateway measures them all within 40 s,
# some 50 small calls a second: bench.routing_quality's chains were a median 1.37x the best with 64, 32 and 8,
# 1.16x with these (unannounced links priced at their upper bound in both)
PROBES_PER_ROUND = 128
FIRST_PROBES_AT_ONCE = 16
FIRST_PROBES_PER_PERIOD = 128
FORGET_AFTER = 120.0  # a server routing has not considered for this long is probed no more
FIRST_PROBE_WAIT = 1.0  # how long routing waits for the first probes of servers it has not measured


class RoundTripProbes:
    """Times round trips for `load` (PeerLoad.round_trip) on the client's event loop `loop` (dht.EventLoop);
    `consider`, `measure_new` and `retry` are called from any thread."""

    def __init__(self, p2p, loop, load: PeerLoad, bans: Bans, period: float = PROBE_PERIOD,
                 timeout: float = PROBE_TIMEOUT, dead: Optional[DeadPeers] = None):
        self.p2p, self.loop, self.load, self.bans = p2p, loop, load, bans
        self.dead = DeadPeers() if dead is None else dead
        self.period, self.timeout = period, timeout
        self._considered: dict[str, float] = {}  # peer -> when routing last looked at it
        self._probed: dict[str, float] = {}  # peer -> when its last probe began
        self._first_running = 0  # first probes in flight
        self._window = (-float("inf"), 0)  # (when the current period of first probes began, how many began since)
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
        """Begin first probes of the servers never probed yet, as many as the bounds allow. While none of `peers`
        is measured (a client's first routing), wait up to `wait` seconds for the probes begun here; otherwise
        route on what is known (a chain chosen meanwhile counts a server not measured at the median round trip)."""
        admitted = self._admit_first(peers)
        if not admitted:
            return
        probes = asyncio.run_coroutine_threadsafe(self._probe_all([], admitted), self.loop.loop)
        if not self.load.round_trips().keys().isdisjoint(peers):
            return
        try:
            probes.result(wait)
        except Exception:  # still on their way: they finish in the background
            pass

    def retry(self, peer: str) -> None:
        """Probe a banned server once, now (its restart earned it: Bans.may_retry); its ban ends if it answers."""

        async def probe_and_pardon():
            if await self.probe(peer):
                self.bans.pardon(peer)

        asyncio.run_coroutine_threadsafe(probe_and_pardon(), self.loop.loop)

    def confirm(self, peer: str) -> None:
        """A step or a session's opening failed there (Bans.on_ban): probe it now, so that a dead server leaves
        routing at once rather than at its next probe."""
        if peer not in self.dead.current():
            asyncio.run_coroutine_threadsafe(self.probe(peer), self.loop.loop)

    async def probe(self, peer: str) -> bool:
        """One round trip to `peer`, timed: whether it answered; a server that does not is banned, and found
        dead."""
        with self._lock:
            self._probed[peer] = time.monotonic()
        began = time.perf_counter()
        try:
            await call_info(self.p2p, peer, timeout=self.timeout)
        except SwarmError as refusal:  # it answered, with an error (a private server's to a stranger): alive
            logger.info("server %s refused a probe (%s): banned for a while", peer, refusal)
            self.bans.ban(peer, probed=True)
            return False
        except Exception as error:  # gone or stalled: routing goes elsewhere meanwhile
            logger.info("server %s did not answer a probe (%r): left out of routing until it announces anew",
                        peer, error)
            self.dead.found_dead(peer)
            self.bans.ban(peer, probed=True)
            return False
        self.load.round_trip(peer, time.perf_counter() - began)
        return True

    def _admit_first(self, peers: Iterable[str]) -> list[str]:
        """Of `peers`, those never probed that may be probed now (picked by chance), counted as begun."""
        now = time.monotonic()
        with self._lock:
            began, count = self._window
            if now - began >= self.period:  # a new period: its own allowance
                began, count = now, 0
            room = min(FIRST_PROBES_AT_ONCE - self._first_running, FIRST_PROBES_PER_PERIOD - count)
            new = [peer for peer in dict.fromkeys(peers) if peer not in self._probed]
            admitted = random.sample(new, max(min(room, len(new)), 0))
            for peer in admitted:
                self._probed[peer] = now
            self._first_running += len(admitted)
            self._window = began, count + len(admitted)
        return admitted

    async def _first_probe(self, peer: str) -> None:
        try:
            await self.probe(peer)
        finally:
            with self._lock:
                self._first_running -= 1

    async def _probe_all(self, again: Iterable[str], first: Iterable[str]) -> None:
        await asyncio.gather(*(self.probe(peer) for peer in again), *(self._first_probe(peer) for peer in first))

    async def _probe_every_period(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            try:
                await self._probe_all(self._due(), self._admit_first(self._considered_not_banned()))
            except Exception:  # never lets the probes stop: a bug here costs one round
                logger.warning("probing servers failed", exc_info=True)

    def _due(self) -> list[str]:
        """The servers probed before that routing still considers, not banned, not probed this period; the least
        recent first. Servers routing no longer considers are forgotten."""
        now, banned = time.monotonic(), self.bans.current()
        with self._lock:
            for peer in [peer for peer, seen in self._considered.items() if now - seen > FORGET_AFTER]:
                del self._considered[peer]
                self._probed.pop(peer, None)
            due = [peer for peer in self._considered if peer not in banned and peer in self._probed
                   and now - self._probed[peer] >= self.period * 0.9]
            due.sort(key=self._probed.__getitem__)
        return due[:PROBES_PER_ROUND]

    def _considered_not_banned(self) -> list[str]:
        banned = self.bans.current()
        with self._lock:
            return [peer for peer in self._considered if peer not in banned]

    def close(self) -> None:
        if self._rounds is not None:
            self._rounds.cancel()
