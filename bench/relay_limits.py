"""What one hostile host can take from a relay started as the product starts it (`python -m bench.relay_limits`).

The relay is the bootstrap peer's node (swarm.dht.start_node(serve_relay=True, relay_limits=...)), restarted
until its configured relay service is the one that answers (p2pd runs a second one, with go-libp2p's defaults:
swarm/relay_check.py). The hostile peers are bare p2pd daemons on the same 127.0.0.1, as hivemind starts
them, with whatever flags suit them: they listen on no address and dial no DHT peers, so every connection between
them is a circuit the bench opens. The "relayed" ones reserve a slot on the relay at once (-relayDiscovery=0
makes it a static relay, which p2pd's auto-relay uses without its 3-minute boot delay); the "dialers" open
circuits through it. A slot is held iff a dialer can open a circuit to its holder (NO_RESERVATION otherwise).

Prints a table: each limit, what was set, what one host got; and the relay p2pd's resident memory (VmRSS).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sys
import tempfile
import time
from dataclasses import dataclass

from swarm.relay_check import (PROBE_BYTES, SINK, configured_service_answers, open_circuit, relayed_peers, shutdown,
                                start_dialer, stream_bytes)
from swarm.relays import RelayLimits

SMALL_BUFFER = 64 << 10  # a relay buffer small enough that the relay's memory limit is not what stops circuits


@dataclass
class Row:
    measure: str
    setting: str
    result: str


def rss_mib(p2p, field: str = "VmRSS") -> float:
    """The daemon's resident memory now (VmRSS) or at its peak (VmHWM), in MiB."""
    with open(f"/proc/{p2p._child.pid}/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith(field))


async def circuits_open(dialers, relay_maddr: str, targets) -> list[str]:
    """Each dialer opens a circuit to each target, one after another."""
    return [await open_circuit(dialer, relay_maddr, target) for dialer in dialers for target in targets]


@contextlib.asynccontextmanager
async def relay_node(limits: RelayLimits, configured: bool = True):
    """The relay as the product starts it on a public address: restarted until its configured relay service is the
    one that answers (swarm/relay_check.py), which a probe finds out at the cost of one slot. `configured` False:
    as it first starts, whichever service answers."""
    from swarm import dht

    node = await dht.start_node(serve_relay=True, relay_limits=limits, check_relay=configured)
    if configured and not node.configured_relay:
        await node.shutdown()
        raise RuntimeError("go-libp2p's default relay service answered at every start of the relay")
    node.maddr = str((await node.get_visible_maddrs())[0])
    try:
        yield node
    finally:
        await node.shutdown()


def _summary(outcomes: list[str]) -> str:
    counts = {outcome: outcomes.count(outcome) for outcome in dict.fromkeys(outcomes)}
    return ", ".join(f"{count} {outcome}" for outcome, count in counts.items())


async def circuits_from_one_dialer(limits: RelayLimits, peers: int) -> list[str]:
    """A relay with `limits`, `peers` relayed peers reserving a slot on it, and one dialer opening a circuit to each
    of them: each circuit's outcome."""
    async with relay_node(limits) as relay:
        targets = await relayed_peers(relay, peers)
        dialer = await start_dialer()
        outcomes = await circuits_open([dialer], relay.maddr, targets)
        await shutdown(dialer, *targets)
    return outcomes


async def reservations_one_host(limit: int = 13, peers: int = 14) -> Row:
    """Distinct peer ids from one address: go-libp2p would let one IP hold 8 slots; p2pd sets its per-peer,
    per-IP and per-ASN limits to the total, so one host holds every slot."""
    limits = RelayLimits(max_reservations=limit, max_circuits=64, buffer_size=SMALL_BUFFER)
    outcomes = await circuits_from_one_dialer(limits, peers)
    return Row("reservations, one host", f"--relay-max-reservations={limit}",
               f"{outcomes.count('ok')} of {peers} peer ids got a slot, the bench's probe 1 ({_summary(outcomes)})")


async def reservations_one_peer_reconnecting(limit: int = 3) -> Row:
    """One peer id that reserves, disconnects and comes back: the relay forgets its reservation, not the slot it
    counted (go-libp2p counts a slot for 30 minutes whatever happens to the reservation). The probe holds one
    of `limit` + 1 slots."""
    async with relay_node(RelayLimits(max_reservations=limit + 1, max_circuits=64, buffer_size=SMALL_BUFFER)) as relay:
        dialer = await start_dialer()
        with tempfile.TemporaryDirectory() as folder:
            identity = os.path.join(folder, "hostile.key")
            outcomes = []
            for _ in range(limit + 1):
                (peer,) = await relayed_peers(relay, 1, identity)
                outcomes.append(await open_circuit(dialer, relay.maddr, peer))
                await dialer._client.disconnect(peer.peer_id)
                await shutdown(peer)
        newcomer = await relayed_peers(relay, 1)
        honest = await open_circuit(dialer, relay.maddr, newcomer[0])
        await shutdown(dialer, *newcomer)
    return Row("reservations, one peer id reconnecting", f"--relay-max-reservations={limit + 1}",
               f"one key started {limit + 1} times in turn: {_summary(outcomes)}; then a new peer: {honest}")


async def circuits_one_peer(max_circuits: int = 4, targets: int = 6) -> Row:
    """One dialer to distinct relayed peers: max_circuits bounds the circuits each peer id opens."""
    outcomes = await circuits_from_one_dialer(RelayLimits(max_circuits=max_circuits, buffer_size=SMALL_BUFFER), targets)
    return Row("circuits, one peer id to many", f"--relay-max-circuits={max_circuits}, buffer 64 KiB",
               f"{outcomes.count('ok')} of {targets} ({_summary(outcomes)})")


async def circuits_to_one_server(max_circuits: int = 4) -> Row:
    """One hostile peer id (several daemons sharing its key) fills a relayed server's circuits: max_circuits
    also bounds the circuits that reach each peer id, so an honest client can no longer reach it."""
    async with relay_node(RelayLimits(max_circuits=max_circuits, buffer_size=SMALL_BUFFER)) as relay:
        (server,) = await relayed_peers(relay, 1)
        with tempfile.TemporaryDirectory() as folder:
            identity = os.path.join(folder, "hostile.key")
            hostile = [await start_dialer(identity) for _ in range(max_circuits + 1)]
            outcomes = await circuits_open(hostile, relay.maddr, [server])
        honest = await start_dialer()
        honest_outcome = await open_circuit(honest, relay.maddr, server)
        await shutdown(honest, server, *hostile)
    return Row("circuits, one peer id to one server", f"--relay-max-circuits={max_circuits}",
               f"hostile: {_summary(outcomes)}; then an honest client: {honest_outcome}")


async def data_limit_cuts(limit_mib: float = 1.0, sent_mib: int = 4) -> Row:
    """A circuit is reset after data_limit bytes each way; the same peer then opens a new circuit, with a
    new allowance: the limit is per circuit, not per peer."""
    limits = RelayLimits(data_limit=int(limit_mib * 2**20), buffer_size=SMALL_BUFFER)
    async with relay_node(limits) as relay:
        (target,), dialer = await relayed_peers(relay, 1), await start_dialer()
        received = []
        for _ in range(2):
            await open_circuit(dialer, relay.maddr, target)
            before = target.received
            await stream_bytes(dialer, target, sent_mib << 20)
            received.append(f"{(target.received - before) / 2**20:.2f}")
        await shutdown(dialer, target)
    return Row("data per circuit", f"--relay-data-limit-mib={limit_mib:g}",
               f"{sent_mib} MiB sent, twice (a new circuit each time): {' and '.join(received)} MiB arrived")


async def time_limit_cuts(seconds: float = 2.0) -> Row:
    """A circuit is reset time_limit seconds after it opened, busy or not: a stream through it that sends a
    little every 0.1 s ends then (the peer may open a new circuit at once: the limit is per circuit)."""
    async with relay_node(RelayLimits(time_limit=seconds, buffer_size=SMALL_BUFFER)) as relay:
        (target,), dialer = await relayed_peers(relay, 1), await start_dialer()
        opened, started = await open_circuit(dialer, relay.maddr, target), time.monotonic()
        with contextlib.suppress(Exception):
            _info, _reader, writer = await dialer.call_binary_stream_handler(target.peer_id, SINK)
            while not target.ended and time.monotonic() - started < 3 * seconds:
                writer.write(bytes(1024))
                await writer.drain()
                await asyncio.sleep(0.1)
        lasted = (target.ended[0] - started) if target.ended else None
        await shutdown(dialer, target)
    return Row("time per circuit", f"--relay-time-limit={seconds:g}",
               f"circuit {opened}; a stream through it ended after {lasted:.1f} s" if lasted else
               f"circuit {opened}; a stream through it still open after {3 * seconds:g} s")


async def memory_per_circuit(buffer_size: int = 16 << 20, circuits: int = 16, sent_mib: int = 32,
                             reads: bool = True) -> Row:
    """The relay p2pd's resident memory with `circuits` circuits from one peer id, idle, then once `sent_mib`
    MiB were sent through each (to peers that read them, or that read nothing: the relay's buffers fill)."""
    async with relay_node(RelayLimits(max_circuits=circuits, buffer_size=buffer_size)) as relay:
        peers, dialer = await relayed_peers(relay, circuits, reads=reads), await start_dialer()
        base = rss_mib(relay.p2p)
        opened = (await circuits_open([dialer], relay.maddr, peers)).count("ok")
        idle = rss_mib(relay.p2p)
        sends = (stream_bytes(dialer, peer, sent_mib << 20) for peer in peers)
        with contextlib.suppress(asyncio.TimeoutError):  # to a peer that reads nothing, a send stalls
            await asyncio.wait_for(asyncio.gather(*sends), 10 + sent_mib * circuits / 50)
        busy, peak = rss_mib(relay.p2p), rss_mib(relay.p2p, "VmHWM")
        await shutdown(dialer, *peers)
    receivers = "receivers" if reads else "receivers that read nothing"
    return Row(f"relay memory, {receivers}", f"buffer {buffer_size >> 10} KiB, {opened} circuits",
               f"RSS {base:.0f} MiB, +{(idle - base) / opened:.2f} MiB a circuit idle, +{(busy - base) / opened:.2f}"
               f" MiB once {sent_mib} MiB were sent through each (peak +{(peak - base) / opened:.2f})")


async def plain_node_relays() -> Row:
    """A node started without serve_relay (p2pd's -relayService=0): does it relay all the same?"""
    from swarm import dht

    node = await dht.start_node()
    try:
        node.maddr = str((await node.get_visible_maddrs())[0])
        (target,), dialer = await relayed_peers(node, 1), await start_dialer()
        outcome = await open_circuit(dialer, node.maddr, target)
        received = target.received
        await stream_bytes(dialer, target, 1 << 20)
        received = (target.received - received) / 2**10
        await shutdown(dialer, target)
    finally:
        await node.shutdown()
    return Row("a node without serve_relay", "-relayService=0", f"circuit through it: {outcome}; "
               f"1024 KiB sent, {received:.0f} KiB arrived")


async def configured_relay_answers(starts: int = 5) -> Row:
    """p2pd starts two relay services on a relay: the configured one (its -relay* flags), once the node knows
    itself public, and one with go-libp2p's defaults (128 KiB and 2 minutes a circuit; 4 slots a peer id, 8 an
    IP address) on every node with -relay=1; the one that registered last answers. Which, over several starts."""
    answers = []
    for _ in range(starts):
        async with relay_node(RelayLimits(buffer_size=SMALL_BUFFER), configured=False) as relay:
            answers.append(await configured_service_answers(relay))
    return Row("which relay service answers", f"{starts} relay starts",
               f"the configured one {sum(answers)} times, go-libp2p's defaults {starts - sum(answers)} times "
               f"({PROBE_BYTES >> 10} KiB through a circuit arrive whole, or 96 KiB)")


MEASURES = (plain_node_relays, configured_relay_answers, reservations_one_host, reservations_one_peer_reconnecting,
            circuits_one_peer, circuits_to_one_server, data_limit_cuts, time_limit_cuts, memory_per_circuit,
            functools.partial(memory_per_circuit, reads=False))


def table(rows: list[Row]) -> str:
    widths = [max(len(getattr(row, field)) for row in rows) for field in ("measure", "setting")]
    return "\n".join(f"{row.measure:<{widths[0]}}  {row.setting:<{widths[1]}}  {row.result}" for row in rows)


async def measure_all() -> list[Row]:
    rows = []
    for measure in MEASURES:
        rows.append(await measure())
        print(table(rows[-1:]), file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> None:
    import argparse

    argparse.ArgumentParser(prog="python -m bench.relay_limits", description=__doc__.split("\n")[0]).parse_args(argv)
    started = time.monotonic()
    rows = asyncio.run(measure_all())
    print(table([Row("measure", "setting", "what one host got"), *rows]))
    print(f"({time.monotonic() - started:.0f} s; relay p2pd: hivemind's, go-libp2p v0.32.1)")


if __name__ == "__main__":
    main()
