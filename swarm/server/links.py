"""A network map's delays on a server (swarm/network_map.py): each exchange delayed by its own link, the one
between this server's region and its caller's.

The receiving server applies the whole link: a message in is held half the link's round trip, its reply out
the other half (SimulatedLatency.wrap's machinery, with the link of `context.remote_id`). Its own outgoing
pushes are not delayed here: the next server delays them by the same link, so a push crosses it once (with
--simulated-latency both ends delay it, and a push pays two servers' latencies).

A caller's region is what it announced in the DHT (dht.fetch_regions), read again when stale, and at most
every second for a peer that announced none (it may have started since); the look-up of a new caller's
region is part of its first message's delay, not added to it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from typing import Optional

from swarm.network_map import NetworkMap
from swarm.server.latency import SimulatedLatency

logger = logging.getLogger(__name__)

# a peer not found is looked up again after a second: a server that just started (and announced its region)
# is known to the others within about that, and a client that announces none costs one DHT get a second at most
REGIONS_TTL, REGIONS_MISS_REFRESH, REGIONS_LOOKUP_TIMEOUT = 30.0, 1.0, 5.0


class Link:
    """One link's delays: `round_trip_ms` plus a draw of jitter per message, half each way."""

    def __init__(self, round_trip_ms: float, jitter_ms: float, draws: random.Random):
        self.round_trip_ms, self.jitter_ms, self.draws = round_trip_ms, jitter_ms, draws

    def one_way(self) -> float:
        return (self.round_trip_ms + self.draws.uniform(0.0, self.jitter_ms)) / 2000.0


class RegionBook:
    """peer id -> the region it announced, as this server's DHT node finds them."""

    def __init__(self):
        self.node = None  # set once the server's node is up (MappedLatency.bind)
        self._regions: dict[str, str] = {}
        self._fetched = -math.inf  # when last looked up (monotonic)
        self._lookup: Optional[asyncio.Lock] = None

    async def region_of(self, peer_id: str) -> Optional[str]:
        if self._stale(peer_id):
            self._lookup = self._lookup or asyncio.Lock()
            async with self._lookup:  # one look-up for all the callers waiting on it
                if self._stale(peer_id):
                    self._regions = await self._fetch()
                    self._fetched = time.monotonic()
        return self._regions.get(peer_id)

    def _stale(self, peer_id: str) -> bool:
        age = time.monotonic() - self._fetched
        return self.node is not None and (age > REGIONS_TTL or (peer_id not in self._regions and
                                                                 age > REGIONS_MISS_REFRESH))

    async def _fetch(self) -> dict[str, str]:
        from swarm import dht

        try:
            return await asyncio.wait_for(dht.fetch_regions(self.node), REGIONS_LOOKUP_TIMEOUT)
        except Exception as error:  # the DHT unreachable a moment: the regions known so far meanwhile
            logger.debug("looking up the peers' regions failed: %r", error)
            return self._regions


class MappedLatency(SimulatedLatency):
    """A server's delays under a network map, as this server in `region`."""

    def __init__(self, network_map: NetworkMap, region: str, book: Optional[RegionBook] = None):
        super().__init__(0.0, 0.0, network_map.seed)
        self.map, self.region = network_map, region
        self.book = book or RegionBook()
        self._draws = network_map.draws(region)  # one generator: the same seed, the same draws in arrival order
        self._links = {other: Link(network_map.round_trip_ms(region, other), network_map.jitter_ms, self._draws)
                       for other in network_map.regions}

    @property
    def enabled(self) -> bool:
        return True  # even a map of zero round trips: its regions are announced, and its links are what it says

    def describe(self) -> str:
        return self.map.describe(self.region)

    def one_way(self) -> float:
        """Within this server's region (what the links of callers of no known region default to, without a
        default_region)."""
        return self._links[self.region].one_way()

    async def delay(self) -> None:
        """Nothing: the server a push goes to delays it, and its reply, by the link between the two."""

    def bind(self, node) -> None:
        self.book.node = node

    async def announce(self, node, expiration: float) -> None:
        from swarm import dht

        await dht.announce_region(node, self.region, expiration)

    async def link(self, context) -> Link:
        return self.link_to(await self.book.region_of(context.remote_id.to_base58()))

    def link_to(self, region: Optional[str]) -> Link:
        """The link to a peer in `region` (None: one that announced none, in the map's default region)."""
        return self._links[region if region in self._links else self.map.default_region or self.region]
