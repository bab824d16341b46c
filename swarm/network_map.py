"""A simulated network map (NETWORK_MAP: a server's --network-map): every process of a swarm on one machine
placed in a region, and each message delayed by the link it crosses, for tests and benchmarks that need links
of their own (a gateway far from servers that are close to each other) where --simulated-latency gives every
exchange with a server the same round trip.

The map is JSON, inline or in a file::

    {"round_trip_ms": [["home", "home", 30], ["home", "dc", 120], ["dc", "dc", 4]],
     "jitter_ms": 10, "seed": 1, "default_region": "home"}

Every pair of the regions named (a region with itself included) must be listed once, in either order: a link
is symmetric. `jitter_ms` (default 0) adds a uniform 0..jitter_ms per round trip (half each way), drawn from
generators seeded with `seed` (default 0). A server says which region it is in by --region, and announces it
in the DHT (its own signed entry under REGIONS_KEY); so may a client (SwarmClient's `region`). A peer that
announces none (the gateway's client, as a rule) is taken to be in `default_region` (default: the region of
whoever receives its messages), and a server started without --region is in it.

Only the receiving server delays (swarm/server/links.py): a message in by half its link's round trip, its
reply out by the other half, so that a server-to-server push is delayed once, by the link between the two.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

REGIONS_KEY = "_swarm.regions"  # the DHT key under which each process announces its region
REGION_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # bounded: anyone may announce one
MAX_REGIONS = 64
MAX_ROUND_TRIP_MS = 60000.0  # as --simulated-latency's bound


class NetworkMapError(ValueError):
    """A map that cannot be used; its message names the setting."""


@dataclass(frozen=True)
class NetworkMap:
    round_trips_ms: Mapping[frozenset, float]  # {region, other region} (one region: within it) -> milliseconds
    jitter_ms: float = 0.0
    seed: int = 0
    default_region: Optional[str] = None
    regions: frozenset = field(default=frozenset())

    def round_trip_ms(self, region: str, other: str) -> float:
        return self.round_trips_ms[frozenset((region, other))]

    def draws(self, region: str) -> random.Random:
        """The jitter's generator of a process in `region`: seeded, and not the same draws as its neighbours'."""
        return random.Random(f"{self.seed}:{region}")

    def describe(self, region: str) -> str:
        """For a server's start-up line."""
        links = ", ".join(f"{other} {self.round_trip_ms(region, other):g} ms" for other in sorted(self.regions))
        jitter = f" + up to {self.jitter_ms:g} ms jitter (seed {self.seed})" if self.jitter_ms else ""
        return f"simulated network map: region {region}, round trips to {links}{jitter}"


def parse_network_map(text: str, setting: str = "NETWORK_MAP") -> NetworkMap:
    """A map from JSON text, or from the file it names (text not starting with '{' or '['); NetworkMapError
    naming `setting` for anything wrong."""
    source = text.strip()
    if not source.startswith(("{", "[")):
        try:
            source = Path(source).read_text()
        except OSError as error:
            raise NetworkMapError(f"{setting}: cannot read the map file {text!r}: {error.strerror}") from None
    try:
        value = json.loads(source)
    except json.JSONDecodeError as error:
        raise NetworkMapError(f"{setting}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise NetworkMapError(f"{setting}: expected a JSON object")
    unknown = set(value) - {"round_trip_ms", "jitter_ms", "seed", "default_region"}
    if unknown:
        raise NetworkMapError(f"{setting}: unknown field(s) {', '.join(sorted(unknown))}")
    round_trips = _round_trips(value.get("round_trip_ms"), setting)
    regions = frozenset(region for pair in round_trips for region in pair)
    default = value.get("default_region")
    if default is not None and default not in regions:
        raise NetworkMapError(f"{setting}: default_region {default!r} is not a region of the map")
    jitter, seed = value.get("jitter_ms", 0), value.get("seed", 0)
    if not _milliseconds(jitter):
        raise NetworkMapError(f"{setting}: jitter_ms must be a number of ms in [0, {MAX_ROUND_TRIP_MS:g}]")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise NetworkMapError(f"{setting}: seed must be an integer")
    return NetworkMap(round_trips, float(jitter), seed, default, regions)


def _round_trips(pairs, setting: str) -> dict[frozenset, float]:
    """{pair: ms} from [[region, region, ms], ...], every pair of the regions named listed exactly once."""
    if not isinstance(pairs, list) or not pairs:
        raise NetworkMapError(f"{setting}: round_trip_ms must be a list of [region, region, milliseconds]")
    found: dict[frozenset, float] = {}
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 3 and all(_region_name(name) for name in pair[:2])
                and _milliseconds(pair[2])):
            raise NetworkMapError(f"{setting}: each round_trip_ms entry must be [region, region, milliseconds "
                                  f"in [0, {MAX_ROUND_TRIP_MS:g}]] (regions: letters, digits, '.', '_', '-'), "
                                  f"got {pair!r:.80}")
        key = frozenset(pair[:2])
        if key in found:
            raise NetworkMapError(f"{setting}: the link {' - '.join(pair[:2])} is listed twice")
        found[key] = float(pair[2])
    regions = sorted({region for key in found for region in key})
    if len(regions) > MAX_REGIONS:
        raise NetworkMapError(f"{setting}: at most {MAX_REGIONS} regions")
    missing = [f"{a} - {b}" for index, a in enumerate(regions) for b in regions[index:] if frozenset((a, b)) not in found]
    if missing:
        raise NetworkMapError(f"{setting}: no round trip for {', '.join(missing[:5])}: every pair of regions "
                              f"(a region with itself too) needs one")
    return found


def _region_name(value) -> bool:
    return isinstance(value, str) and REGION_PATTERN.fullmatch(value) is not None


def _milliseconds(value) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and 0 <= value <= MAX_ROUND_TRIP_MS)


def parse_region(value, network_map: Optional[NetworkMap], setting: str = "--region") -> Optional[str]:
    """A process's region: one of the map's (None where no region is set); NetworkMapError otherwise."""
    if not value:
        return None
    if network_map is not None and value not in network_map.regions:
        raise NetworkMapError(f"{setting}: {value!r} is not a region of the network map "
                              f"({', '.join(sorted(network_map.regions))})")
    if not _region_name(value):
        raise NetworkMapError(f"{setting}: {value!r:.80} is not a region name (letters, digits, '.', '_', '-')")
    return value


def region_of_wire(value) -> Optional[str]:
    """A region as found in the DHT (anyone may write one there): a bounded name, else None."""
    return value if _region_name(value) else None
