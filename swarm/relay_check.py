"""Which relay service answers on a relay node: the one configured with the swarm's limits, or the second one p2pd
starts with go-libp2p's defaults (128 KiB and 2 minutes a circuit: see swarm/relays.py).

The two register the same protocol, and whichever registers last answers: in 8 starts of a relay here (2026-11-29)
the configured one answered twice. Behind the defaults, a relayed server's circuits are reset every 128 KiB, a few
dozen tokens of a real model's hidden states, and each reset fails its sessions over. So a relay that serves on a
public address checks, once started, which service answers (`configured_service_answers`: a peer that reserves a
slot on it, and a dialer that streams PROBE_BYTES to that peer through a circuit; all of them arrive only through
the configured service), and starts its daemon again until the configured one does (swarm/dht.py's start_node).

The peers here are bare p2pd daemons on 127.0.0.1, as hivemind starts them: they listen on no address and dial no
DHT peers, so every connection between them is a circuit through the relay. bench/relay_limits.py drives the same
peers as hostile ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from swarm.relays import daemon_class, relay_options

PROBE_BYTES = 256 << 10  # more than go-libp2p's default relay service lets through a circuit
SINK = "swarm.relay_check.sink"  # the stream handler every relayed peer runs: it counts the bytes that reach it
# dialers run no libp2p DHT (its lookups would open circuits between the peers) and relay for nobody
BARE = {"dhtClient": False, "relayService": False}
# every such peer listens on no address (nothing dials it but through the relay), and punches no hole
UNLISTED = dict(no_listen=True, dht_mode="client", nat_port_map=False, auto_nat=False)
DIAL_TIMEOUT = 5.0  # seconds: a refused circuit fails at once; a dial with no answer gives up after this
RESERVE_WAIT = 0.5  # seconds for a relayed peer's auto-relay to take its slot once connected to the relay
CONNECT_WAIT = 30.0  # seconds for relayed peers to connect to the relay (all at once on a loaded machine)
ARRIVAL_WAIT = 10.0  # seconds at most for the bytes of a stream to reach its receiver
FIRST_BYTES_WAIT = 3.0  # of which, for its first bytes (a circuit refused or cut at once carries none)


class CircuitAddress:
    """RELAY/p2p-circuit as p2pd reads it: hivemind's Multiaddr writes a /p2p/ part as a CID, which p2pd's
    multiaddr parser refuses in a connect request (it wants the bare multihash)."""

    def __init__(self, relay_maddr: str):
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        transport, relay_id = relay_maddr.rstrip("/").split("/p2p/")
        multihash = PeerID.from_base58(relay_id).to_bytes()
        p2p_code, circuit_code = 421, 290
        self.data = (Multiaddr(transport).to_bytes() + _varint(p2p_code) + _varint(len(multihash)) + multihash
                     + _varint(circuit_code))

    def to_bytes(self) -> bytes:
        return self.data


def _varint(number: int) -> bytes:
    out = bytearray()
    while number >= 0x80:
        out.append(number & 0x7F | 0x80)
        number >>= 7
    return bytes(out + bytes([number]))


async def start_relayed(relay_maddr: str, identity_path: str | None = None, reads: bool = True):
    """A peer that reserves a slot on the relay at once, and counts the bytes streamed to it (.received) and when
    each stream to it ended (.ended). One that `reads` nothing lets the relay's buffers fill."""
    # p2pd's auto-relay wants its DHT on: a client one, which dials no peer that is not a DHT server
    daemon = daemon_class({"relayService": False, "relayDiscovery": False})
    p2p = await daemon.create(**UNLISTED, identity_path=identity_path, **relay_options([relay_maddr]))
    p2p.received, p2p.ended = 0, []

    async def sink(_info, reader, _writer):
        with contextlib.suppress(Exception):
            while reads or await asyncio.Event().wait():  # a peer that reads nothing: never
                if not (chunk := await reader.read(1 << 16)):
                    break
                p2p.received += len(chunk)
        p2p.ended.append(time.monotonic())

    await p2p.add_binary_stream_handler(SINK, sink)
    return p2p


async def start_dialer(identity_path: str | None = None):
    """A peer that opens circuits through the relay (no hole punching: a circuit stays a circuit)."""
    return await daemon_class(BARE).create(**UNLISTED, identity_path=identity_path)


async def relayed_peers(relay, count: int, identity_path: str | None = None, reads: bool = True) -> list:
    """`count` relayed peers on `relay` (a node, its multiaddr in .maddr), once each is connected to the relay and
    has had time to reserve its slot."""
    peers = await asyncio.gather(*(start_relayed(relay.maddr, identity_path, reads) for _ in range(count)))
    deadline = time.monotonic() + CONNECT_WAIT
    while time.monotonic() < deadline:
        connected = {info.peer_id for info in await relay.p2p._client.list_peers()}
        if all(peer.peer_id in connected for peer in peers):
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(RESERVE_WAIT)
    return list(peers)


async def open_circuit(dialer, relay_maddr: str, target) -> str:
    """'ok', or why the relay (or the dial) refused the circuit."""
    try:
        await asyncio.wait_for(dialer._client.connect(target.peer_id, [CircuitAddress(relay_maddr)]), DIAL_TIMEOUT)
        return "ok"
    except asyncio.TimeoutError:
        return "timeout"
    except Exception as error:  # p2pd's ControlFailure: its message names the relay's status
        for status in ("NO_RESERVATION", "RESOURCE_LIMIT_EXCEEDED", "PERMISSION_DENIED"):
            if status in str(error):
                return status
        return str(error)[:80]


async def stream_bytes(dialer, target, size: int) -> None:
    """Send `size` bytes to the target's sink over a new stream; a circuit cut on the way ends it early."""
    start = target.received
    with contextlib.suppress(Exception):
        _info, _reader, writer = await dialer.call_binary_stream_handler(target.peer_id, SINK)
        chunk = bytes(1 << 16)
        for _ in range(size // len(chunk)):
            writer.write(chunk)
            await writer.drain()
        writer.close()
    # what is on its way arrives: until its first bytes come (FIRST_BYTES_WAIT at most), then for as long as bytes
    # still come, ARRIVAL_WAIT in all (a fixed wait ended early on a loaded machine: a configured service's circuit
    # read as one cut at 128 KiB, and a circuit whose first bytes took over half a second as one that carried none)
    await asyncio.sleep(0.25)
    began, before = time.monotonic(), -1
    while time.monotonic() < began + ARRIVAL_WAIT and (target.received != before or (
            target.received == start and time.monotonic() < began + FIRST_BYTES_WAIT)):
        before = target.received
        await asyncio.sleep(0.25)


async def shutdown(*peers) -> None:
    await asyncio.gather(*(peer.shutdown() for peer in peers), return_exceptions=True)


async def configured_service_answers(relay) -> bool:
    """Whether PROBE_BYTES through a circuit on `relay` (a node, its multiaddr in .maddr) arrive whole: go-libp2p's
    default relay service cuts a circuit at 128 KiB, whatever the relay was told. It holds one slot of the relay's
    (go-libp2p counts a slot for 30 minutes) while it runs."""
    (target,), dialer = await relayed_peers(relay, 1), await start_dialer()
    try:
        await open_circuit(dialer, relay.maddr, target)
        await stream_bytes(dialer, target, PROBE_BYTES)
        return target.received == PROBE_BYTES
    finally:
        await shutdown(dialer, target)
