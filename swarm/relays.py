"""Servers behind a NAT: libp2p circuit relays through public peers of the swarm.

A server that accepts no inbound connection (behind a home router, a firewall) dials out to public peers of the
swarm (`python -m swarm.server --relay-through MADDR ...`), reserves a slot on them (libp2p circuit relay v2,
through p2pd's auto-relay with them as its static relays), and is reached at `MADDR/p2p-circuit/p2p/ITS_ID`:
every stream to it goes through the relay. Every node can dial such an address (p2pd's relay transport is on
everywhere); the bootstrap peer and block servers with --serve-as-relay relay within the limits they are given.

What p2pd (hivemind 1.1.12's go-libp2p) does and how it is worked around here:

- its auto-relay, left to discover relays, reserves slots only once it has found 4 candidates, or 3 minutes after
  it started (its boot delay): with -relayDiscovery=0 it takes the relays it is given as they are, and reserves on
  them at once, one relay as well as four (measured: well under a second, bench/relay_limits.py), so every node
  starts with discovery off, and a relayed server announces itself online a moment after it starts (RelayWait);
- it builds its circuit addresses only from a relay's public addresses (a relay on a private network, 10.x or
  192.168.x, gives none): a relayed server announces the circuit addresses through the relays it was given
  itself, so they must be addresses every client can dial;
- its relay service is on by default in every node that finds itself public (AutoNAT), for any peer, within
  limits that hivemind does not let one set (128 reservations in all, 16 circuits per peer, each circuit carrying
  up to 4 GiB each way for 30 minutes). Here it is asked for only where a relay is wanted (the bootstrap peer,
  unless --no-relay; a server with --serve-as-relay), with the limits of RelayLimits (the bootstrap peer's flags
  set them), passed to p2pd as its -relay* flags (relay_service_flags);
- but p2pd also starts a second relay service, with go-libp2p's defaults (128 KiB and 2 minutes a circuit, 4
  slots a peer id, 8 an IP address), on every node with -relay=1, which every node needs to dial relayed peers:
  every node relays within those defaults, -relayService=0 or not, and on a relay whichever service registered
  last answers, the configured one or the defaults (a race: measured, both happen);
- p2pd offers no flag that limits a relay to the swarm's own servers (go-libp2p's relay ACL and connection
  gater are not exposed), and sets the per-peer, per-IP and per-ASN reservation limits to the total: one host
  may take every slot, with distinct peer ids or with one that reconnects (a slot stays counted 30 minutes).
  max_circuits bounds the circuits from each peer id and to each (one peer id can fill a relayed server's).

`python -m bench.relay_limits` measures all of this on real daemons; docs/wan.md has the figures.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Sequence

logger = logging.getLogger(__name__)

# p2pd's auto-relay, given its relays (no discovery), reserves in well under a second on a LAN: a margin before a
# relayed server goes online
RESERVATION_MARGIN = 5.0


def relay_options(relays: Sequence[str] = (), serve_relay: bool = False) -> dict:
    """hivemind P2P.create's relay settings for a node.

    Every node dials relayed peers (use_relay: circuit addresses), and direct addresses first, as before: a
    direct connection never takes a detour. `serve_relay`: the node says it is public (no AutoNAT guess, which
    a swarm of a few peers cannot confirm), and p2pd's relay service runs only on a public node. `relays`: the
    node accepts no inbound connection; it reserves slots on these peers and announces only the circuit
    addresses through them."""
    if relays:
        return dict(use_relay=True, use_auto_relay=True, force_reachability="private", trusted_relays=list(relays),
                    announce_maddrs=[circuit_address(relay) for relay in relays])
    return dict(use_relay=True, use_auto_relay=False, force_reachability="public" if serve_relay else None)


@dataclass(frozen=True)
class RelayLimits:
    """What a relay gives the peers it relays for: p2pd's -relay* flags, p2pd's defaults unless an operator sets
    them (python -m swarm.dht --relay-*), but for the buffer. One host may hold every reservation, and each of
    its peer ids max_circuits circuits, each holding up to 2 x buffer_size bytes of the relay's memory (the
    relay's p2pd runs no resource manager limits): measured well under 1 MiB a circuit (bench/relay_limits.py)."""

    max_reservations: int = 128  # reserved slots in all, whoever holds them (p2pd counts no peer's share)
    max_circuits: int = 16  # relayed connections open at once per peer
    data_limit: int = 4 << 30  # bytes a circuit carries each way before the relay resets it (a failover)
    time_limit: float = 1800.0  # seconds a circuit lasts before the relay resets it
    # bytes of copy buffer per relayed connection, each way: p2pd's 16 MiB bounds a circuit's memory at 32 MiB
    # for no speed (measured: 64 KiB relays as fast on loopback, >100 MiB/s)
    buffer_size: int = 64 << 10

    def __post_init__(self):
        for name in ("max_reservations", "max_circuits", "data_limit", "time_limit", "buffer_size"):
            value = getattr(self, name)
            if not (0 < value < math.inf):
                raise ValueError(f"relay limit {name} must be a positive number, not {value!r}")


def relay_service_flags(serve_relay: bool, limits: RelayLimits = RelayLimits()) -> dict:
    """p2pd's flags for its configurable relay service: off unless the node serves as a relay (p2pd runs it on
    any node that finds itself public), and within `limits` where it does. p2pd's second relay service, with
    go-libp2p's defaults, runs on every node whatever these say (see above). Relay discovery is off everywhere: a
    relayed node reserves on the relays it was given, at once (see above); no other node has an auto-relay."""
    if not serve_relay:
        return {"relayService": False, "relayDiscovery": False}
    return {"relayService": True, "relayDiscovery": False, "relayMaxReservations": limits.max_reservations,
            "relayMaxCircuits": limits.max_circuits, "relayDataLimit": limits.data_limit,
            "relayTimeLimit": f"{limits.time_limit:g}s", "relayBufferSize": limits.buffer_size}


def daemon_class(flags: dict):
    """hivemind's P2P, starting its p2pd with these extra flags too (P2P.create takes no relay service flags)."""
    from hivemind.p2p import P2P

    class P2PWithFlags(P2P):
        @staticmethod
        def _make_process_args(*args, **kwargs):
            return P2P._make_process_args(*args, **{**kwargs, **flags})

    return P2PWithFlags


def circuit_address(relay: str) -> str:
    """Where a relayed peer is reached through `relay` (a multiaddr ending in the relay's /p2p/ID)."""
    return f"{relay.rstrip('/')}/p2p-circuit"


class RelayWait:
    """Until when a relayed server must wait before it announces itself online: until p2pd's auto-relay has
    reserved its slots on the relays it was given (a moment: RESERVATION_MARGIN), or clients would find it
    unreachable and ban it meanwhile. A direct server waits for nothing."""

    def __init__(self, relays: Sequence[str], started: float):
        self.relays, self.started = tuple(relays), started
        self.ready_at = started + (RESERVATION_MARGIN if self.relays else 0.0)

    @classmethod
    def starting_now(cls, relays: Sequence[str]) -> "RelayWait":
        return cls(relays, time.monotonic())

    async def until_reserved(self) -> None:
        remaining = self.ready_at - time.monotonic()
        if remaining > 0:
            logger.info("waiting %.0f s for the relay reservation before announcing online", remaining)
            await asyncio.sleep(remaining)
