"""The client's own view of the servers: peers banned for a while, peers found dead, and the load it put on each."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Callable, Iterable, Optional

from swarm.protocol import RemoteServer

# a restart lifts the ban of a peer with at most this many strikes (if it answers a probe): a server that failed
# once or twice and restarted is back at once; one that keeps failing waits out its bans
PARDONABLE_STRIKES = 2
# probes a round trip is the least of: at a probe per 5 s (probes.py), a route that got farther counts within 30 s
RTT_SAMPLES = 6
# what one more session of this client adds to a server's step, as a share of it: a server batches its sessions'
# steps into one round, where a session adds its rows, not a round (bench.span_round on 2 CPU cores: a decode round
# of 16 sessions takes 1.36x one of 1, 2.4% a session); the compute a client measures there counts the rest
SESSION_WEIGHT = 0.1
COMPUTE_SAMPLES = 15  # decode steps a server's compute per block is the least of
# a server's measured compute counts this long after the client's last step there; then its announced speed counts
# again (bench.routing_quality: with the median of the last 15 kept for good, chosen chains were a median 1.90x the
# best under the true speeds; with the least, forgotten after 30 s, 1.42x)
COMPUTE_FRESH_SECONDS = 30.0


class Bans:
    """Peers left out of routing for a while. A failure (dead, stalled, cut off) is a strike, and bans a peer for
    a time that doubles with its strikes; routing still falls back on it when no other server holds its blocks. A
    peer caught answering wrong is distrusted: never routed to until its ban ends.

    Strikes fade with time only (one per `decay_seconds` without a failure), never with a restart: a restart is
    the peer's own word (a newer `started` in its record), which a peer may announce whenever it likes, and a
    stalling one did after each ban. A restart earns a banned peer one probe (`may_retry`), which lifts the ban if
    it answers (`pardon`), while the peer has at most `pardonable` strikes; its strikes stay, so that each new
    failure bans it longer."""

    def __init__(self, base_seconds: float = 30.0, max_seconds: float = 600.0,
                 decay_seconds: Optional[float] = None, pardonable: int = PARDONABLE_STRIKES):
        self.base, self.max = base_seconds, max_seconds
        self.decay = max_seconds if decay_seconds is None else decay_seconds
        self.pardonable = pardonable
        self._until: dict[str, float] = {}
        self._distrusted_until: dict[str, float] = {}
        self._strikes: dict[str, tuple[int, float]] = {}  # peer -> (strikes, when the last one was struck)
        self._retried: set[str] = set()  # peers probed for a restart since their last strike
        # told of each ban but a probe's (the client probes the peer at once: a dead one leaves routing for good)
        self.on_ban: Optional[Callable[[str], None]] = None
        # grows with each distrust: a session compares it with the one it saw last, at each step, to leave a liar
        self.distrust_epoch = 0
        self._lock = threading.Lock()

    def ban(self, peer_id: str, seconds: Optional[float] = None, distrust: bool = False, probed: bool = False) -> None:
        """Ban for `seconds`, or by default for the peer's strikes so far; a ban is never shortened. `probed`: the
        failure was a probe's (on_ban is not told: there is nothing more a probe could find)."""
        self._strike(peer_id, seconds, distrust)
        if self.on_ban is not None and not probed:
            self.on_ban(peer_id)

    def _strike(self, peer_id: str, seconds: Optional[float], distrust: bool) -> None:
        with self._lock:
            now = time.monotonic()
            strikes = self._live_strikes(peer_id, now) + 1
            self._strikes[peer_id] = (strikes, now)
            self._retried.discard(peer_id)
            seconds = min(self.base * 2 ** (strikes - 1), self.max) if seconds is None else seconds
            for bans in (self._until, self._distrusted_until) if distrust else (self._until,):
                bans[peer_id] = max(bans.get(peer_id, 0.0), now + seconds)
            self.distrust_epoch += distrust

    def strikes(self, peer_id: str) -> int:
        """The peer's failures that still count (those not faded with time)."""
        with self._lock:
            return self._live_strikes(peer_id, time.monotonic())

    def may_retry(self, peer_id: str) -> bool:
        """The peer restarted: whether it earns a probe that lifts its ban if answered (see `pardon`). Only a peer
        banned now for failures (not distrusted), with at most `pardonable` strikes, and once per ban: announcing
        more restarts earns nothing more."""
        with self._lock:
            now = time.monotonic()
            if self._until.get(peer_id, 0.0) <= now or self._distrusted_until.get(peer_id, 0.0) > now:
                return False
            if peer_id in self._retried or self._live_strikes(peer_id, now) > self.pardonable:
                return False
            self._retried.add(peer_id)
            return True

    def pardon(self, peer_id: str) -> None:
        """A restarted peer answered the probe its restart earned: its failure ban ends, its strikes stay (a
        distrusted peer stays distrusted: its operator is the same)."""
        with self._lock:
            if self._distrusted_until.get(peer_id, 0.0) <= time.monotonic():
                self._until.pop(peer_id, None)

    def current(self) -> set[str]:
        return self._live(self._until)

    def distrusted(self) -> set[str]:
        return self._live(self._distrusted_until)

    def _live(self, bans: dict[str, float]) -> set[str]:
        now = time.monotonic()
        with self._lock:
            return {peer for peer, until in bans.items() if until > now}

    def _live_strikes(self, peer_id: str, now: float) -> int:
        """Strikes less one per `decay` seconds since the last (the caller holds the lock)."""
        strikes, last = self._strikes.get(peer_id, (0, now))
        return max(strikes - int((now - last) / self.decay), 0) if self.decay > 0 else 0


class DeadPeers:
    """Servers found dead (a probe unanswered, a connection refused), left out of routing for the rest of the
    record they had then, fallbacks included. A server killed without a word leaves its record in the DHT until it
    expires (three announce periods); a ban alone lets routing fall back on it while no other server holds its
    blocks, and sends every session there to fail. A dead server announces nothing more: the mark lasts while its
    newest record is the one seen when it was found dead, and ends with a newer one (it is back, or was only
    stalled: it announces every period) or when that record expires. Bans still apply as they do to any failure."""

    def __init__(self):
        self._expires: dict[str, float] = {}  # peer -> when the newest record seen of it expires
        self._dead: dict[str, float] = {}  # peer -> when the record it had when found dead expires
        self._lock = threading.Lock()

    def seen(self, servers: Iterable[RemoteServer]) -> None:
        """The records a lookup found: a dead peer's newer record ends its mark."""
        now = time.time()
        with self._lock:
            for server in servers:
                self._expires[server.peer_id] = server.expires
                if self._dead.get(server.peer_id, math.inf) < server.expires:
                    del self._dead[server.peer_id]
            for peer in [peer for peer, expires in self._expires.items() if expires < now]:
                del self._expires[peer]  # only records still alive are remembered: what a swarm announces now
            for peer in [peer for peer, expires in self._dead.items() if expires < now]:
                del self._dead[peer]

    def found_dead(self, peer_id: str) -> bool:
        """The peer failed a probe: dead until a newer record than the one seen; whether this is news. A peer
        no lookup has shown (not one routing knows) is not remembered."""
        with self._lock:
            if peer_id not in self._expires or peer_id in self._dead:
                return False
            self._dead[peer_id] = self._expires[peer_id]
            return True

    def current(self) -> set[str]:
        with self._lock:
            return set(self._dead)


class PeerLoad:
    """The client's own view of each server: the sessions it has open there, so that new sessions spread over
    replicas instead of piling onto the first; the round trip to it (swarm/client/probes.py times a cheap call);
    and how fast its steps really compute there (what routing trusts over the speed a server announces: any
    peer may announce anything). A step's time is its round trip plus its compute: only the compute is per block.
    `clock`: seconds, monotonic (a simulation's own in bench/routing_quality.py)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.sessions: dict[str, int] = {}
        self.latency: dict[str, float] = {}  # compute seconds per block of a decode step: the least of the last few
        self._compute_samples: dict[str, deque] = {}
        self._stepped: dict[str, float] = {}  # when the client last stepped through each server
        self.rtt: dict[str, float] = {}  # the least of the last RTT_SAMPLES round trips, in seconds
        self._rtt_samples: dict[str, deque] = {}
        self._clock = clock
        self._lock = threading.Lock()

    def opened(self, peer_id: str, change: int = 1) -> None:
        with self._lock:
            self.sessions[peer_id] = max(self.sessions.get(peer_id, 0) + change, 0)

    def observed(self, peer_id: str, seconds: float, blocks: int = 1) -> None:
        """A decode step through `blocks` blocks of the server took `seconds`, as this client saw it: less the
        round trip (once measured), the rest is compute. The least of the last COMPUTE_SAMPLES: queueing (a busy
        moment, a loaded machine) only ever adds to a step, as to a probe, so the least is the nearest to the
        server's compute; a server that really got slower counts so once its last few steps all say it."""
        with self._lock:
            network = min(self.rtt.get(peer_id, 0.0), seconds)
            samples = self._compute_samples.setdefault(peer_id, deque(maxlen=COMPUTE_SAMPLES))
            samples.append((seconds - network) / max(blocks, 1))
            self.latency[peer_id] = min(samples)
            self._stepped[peer_id] = self._clock()

    def round_trip(self, peer_id: str, seconds: float) -> None:
        """A call that costs the server next to nothing (rpc_info) took `seconds` there and back. The least of
        the last few is the network's: queueing (a busy server's loop, a loaded machine) only ever adds to a
        probe, and it is counted in the compute a step takes there, as steps measure it (see observed)."""
        with self._lock:
            samples = self._rtt_samples.setdefault(peer_id, deque(maxlen=RTT_SAMPLES))
            samples.append(seconds)
            self.rtt[peer_id] = min(samples)

    def factors(self) -> dict[str, float]:
        """Multipliers of each server's estimated time: each session this client has there weighs SESSION_WEIGHT
        (new sessions spread over replicas that are otherwise alike, rather than pile onto the first)."""
        with self._lock:
            return {peer: 1.0 + SESSION_WEIGHT * sessions for peer, sessions in self.sessions.items()}

    def measured(self) -> dict[str, float]:
        """Compute seconds per block of a decode step on each server this client stepped through in the last
        COMPUTE_FRESH_SECONDS. An older figure is dropped: a measurement only ever makes a server look slower
        than it announces, so one kept for good would keep a server that sped up out of routing."""
        with self._lock:
            now = self._clock()
            return {peer: seconds for peer, seconds in self.latency.items()
                    if now - self._stepped[peer] <= COMPUTE_FRESH_SECONDS}

    def round_trip_to(self, peer_id: str) -> Optional[float]:
        """Seconds there and back to one server, if measured (what a step asks: no copy of every server's)."""
        return self.rtt.get(peer_id)  # one read of a dict: whole under the GIL, no lock needed

    def round_trips(self) -> dict[str, float]:
        """Seconds there and back to each server measured."""
        with self._lock:
            return dict(self.rtt)
