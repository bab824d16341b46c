"""Round trips a server measures to the servers it pushes to (swarm/server/pushes.py: its pushes, and pings of
the servers of the block after its span at each announcement), announced in its record (ServerInfo.round_trips)
so that clients price the server-to-server hops of flowing steps by them (swarm/client/flowing_routes.py).

A push's reply comes as soon as the next server has queued the step (Backend.accept_pushes), not once it is
computed: from sending a push to its reply is the network's round trip, plus what the two event loops add
under load. The median of the last few is announced, so that one push queued behind a burst does not make a
close server look far.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from typing import Optional

from swarm.protocol import MAX_ROUND_TRIP_SECONDS, MAX_ROUND_TRIPS

SAMPLES = 8  # round trips kept per server
PEERS_KEPT = 4 * MAX_ROUND_TRIPS  # servers remembered; the most recently pushed to are announced


class PushRoundTrips:
    def __init__(self):
        self._samples: OrderedDict[str, deque] = OrderedDict()  # peer -> its last SAMPLES, least recent first

    def add(self, peer_id: str, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        samples = self._samples.pop(peer_id, None) or deque(maxlen=SAMPLES)
        samples.append(seconds)
        self._samples[peer_id] = samples
        while len(self._samples) > PEERS_KEPT:
            self._samples.popitem(last=False)

    def median(self, peer_id: str) -> Optional[float]:
        """The median of the last round trips to `peer_id`; None where none was measured."""
        samples = self._samples.get(peer_id)
        return statistics.median(samples) if samples else None

    def announced(self) -> tuple[tuple[str, float], ...]:
        """(peer id, seconds) of the MAX_ROUND_TRIPS servers most recently pushed to, within the records'
        bounds (ServerInfo.from_wire), by peer id."""
        recent = list(self._samples.items())[-MAX_ROUND_TRIPS:]
        return tuple(sorted((peer, min(statistics.median(samples), MAX_ROUND_TRIP_SECONDS))
                            for peer, samples in recent))
