"""The client's own view of the servers: peers banned for a while, and the load it put on each."""

from __future__ import annotations

import threading
import time
from typing import Optional


class Bans:
    """Peers left out of routing for a while. A failure (dead, stalled, cut off) bans a peer for a time that
    doubles on each repeat, and routing still falls back on it when no other server holds its blocks; a peer
    caught answering wrong is distrusted: never routed to until its ban ends."""

    def __init__(self, base_seconds: float = 30.0, max_seconds: float = 600.0):
        self.base, self.max = base_seconds, max_seconds
        self._until: dict[str, float] = {}
        self._distrusted_until: dict[str, float] = {}
        self._strikes: dict[str, int] = {}
        self._lock = threading.Lock()

    def ban(self, peer_id: str, seconds: Optional[float] = None, distrust: bool = False) -> None:
        """Ban for `seconds`, or by default for the peer's strikes so far; a ban is never shortened."""
        with self._lock:
            strikes = self._strikes[peer_id] = self._strikes.get(peer_id, 0) + 1
            seconds = min(self.base * 2 ** (strikes - 1), self.max) if seconds is None else seconds
            for bans in (self._until, self._distrusted_until) if distrust else (self._until,):
                bans[peer_id] = max(bans.get(peer_id, 0.0), time.monotonic() + seconds)

    def lift(self, peer_id: str) -> None:
        """The peer restarted (its record shows a newer start): what it failed before says nothing of it now. A
        distrusted peer (caught answering wrong) stays distrusted: its operator is the same."""
        with self._lock:
            if self._distrusted_until.get(peer_id, 0.0) > time.monotonic():
                return
            self._until.pop(peer_id, None)
            self._strikes.pop(peer_id, None)

    def current(self) -> set[str]:
        return self._live(self._until)

    def distrusted(self) -> set[str]:
        return self._live(self._distrusted_until)

    def _live(self, bans: dict[str, float]) -> set[str]:
        now = time.monotonic()
        with self._lock:
            return {peer for peer, until in bans.items() if until > now}


class PeerLoad:
    """The client's own view of each server: the sessions it has open there, so that new sessions spread over
    replicas instead of piling onto the first; the round trip to it (swarm/client/probes.py times a cheap call);
    and how fast its steps really compute there (what routing trusts over the speed a server announces: any
    peer may announce anything). A step's time is its round trip plus its compute: only the compute is per block."""

    def __init__(self):
        self.sessions: dict[str, int] = {}
        self.latency: dict[str, float] = {}  # an exponential moving average of compute seconds per block of a step
        self.rtt: dict[str, float] = {}  # an exponential moving average of round trips, in seconds
        self._lock = threading.Lock()

    def opened(self, peer_id: str, change: int = 1) -> None:
        with self._lock:
            self.sessions[peer_id] = max(self.sessions.get(peer_id, 0) + change, 0)

    def observed(self, peer_id: str, seconds: float, blocks: int = 1) -> None:
        """A decode step through `blocks` blocks of the server took `seconds`, as this client saw it: less the
        round trip (once measured), the rest is compute."""
        with self._lock:
            network = min(self.rtt.get(peer_id, 0.0), seconds)
            per_block = (seconds - network) / max(blocks, 1)
            self.latency[peer_id] = _average(self.latency.get(peer_id), per_block)

    def round_trip(self, peer_id: str, seconds: float) -> None:
        """A call that costs the server next to nothing (rpc_info) took `seconds` there and back."""
        with self._lock:
            self.rtt[peer_id] = _average(self.rtt.get(peer_id), seconds)

    def forget(self, peer_id: str) -> None:
        """What was measured of a server that left: it may come back elsewhere, or faster."""
        with self._lock:
            self.rtt.pop(peer_id, None)
            self.latency.pop(peer_id, None)

    def factors(self) -> dict[str, float]:
        """Multipliers of each server's estimated time: each session this client has there weighs."""
        with self._lock:
            return {peer: 1.0 + sessions for peer, sessions in self.sessions.items()}

    def measured(self) -> dict[str, float]:
        """Compute seconds per block of a decode step on each server this client has stepped through."""
        with self._lock:
            return dict(self.latency)

    def round_trips(self) -> dict[str, float]:
        """Seconds there and back to each server measured."""
        with self._lock:
            return dict(self.rtt)


def _average(previous: Optional[float], sample: float, weight: float = 0.2) -> float:
    return sample if previous is None else (1 - weight) * previous + weight * sample
