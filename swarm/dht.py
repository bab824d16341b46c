"""The DHT side of hivemind: a process's event loop, a node, and the records servers announce and clients read.

Synchronous code (the gateway's threads, command-line tools) reaches the asynchronous libp2p world through
`EventLoop.get().run(coroutine)`: one loop in a daemon thread per process, created on first use (never at
import, never in a gunicorn master, and again after a fork).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import Counter
from typing import Collection, Iterable, Optional, Sequence

from swarm import directory
from swarm.directory import record_key, start_keys
from swarm.protocol import CATALOGUE_KEY, ModelRecord, RemoteServer, ServerInfo, ServerState

logger = logging.getLogger(__name__)


class EventLoop:
    _instance: Optional["EventLoop"] = None
    _lock = threading.Lock()

    def __init__(self):
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="swarm-event-loop", daemon=True)
        self.thread.start()

    @classmethod
    def get(cls) -> "EventLoop":
        with cls._lock:
            if cls._instance is None or cls._instance.pid != os.getpid():
                cls._instance = cls()
            return cls._instance

    def run(self, coroutine, timeout: Optional[float] = None):
        """Run a coroutine on the loop from another thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)


RELAY_STARTS = 8  # a relay's daemon started at most this many times until its configured relay service answers


async def start_node(
    initial_peers: Iterable[str] = (),
    host: str = "127.0.0.1",
    port: int = 0,
    identity_path: Optional[str] = None,
    client_mode: bool = False,
    relays: Sequence[str] = (),
    serve_relay: bool = False,
    relay_limits=None,
    announce_maddrs: Sequence[str] = (),
    check_relay: Optional[bool] = None,
):
    """A DHT node with its own libp2p daemon, joined to the given peers (none: a new swarm). It signs the
    records it stores with its identity key, and refuses forged ones (see swarm/trust.py).

    `relays`: the node accepts no inbound connection and is reached through these public peers; `serve_relay`:
    it is public and relays for such nodes, within `relay_limits` (a relays.RelayLimits; default: p2pd's); no
    other node relays for anyone (see swarm/relays.py). `announce_maddrs`: the only addresses the node gives out,
    in place of those it listens on (a forwarded port's: swarm/server/addresses.py).

    `check_relay` (by default: a relay on any address but loopback's): its daemon is started again, up to
    RELAY_STARTS times, until the relay service that answers is the one configured with `relay_limits`, not the
    one with go-libp2p's defaults that p2pd also runs (swarm/relay_check.py); the node's `configured_relay` says
    whether it is (None: not checked). A few seconds a start: a swarm on one machine relays for nobody far."""
    arguments = dict(initial_peers=initial_peers, host=host, port=port, identity_path=identity_path,
                     client_mode=client_mode, relays=relays, serve_relay=serve_relay, relay_limits=relay_limits,
                     announce_maddrs=announce_maddrs)
    checking = serve_relay and (check_relay if check_relay is not None else not _loopback(host))
    if not checking:
        node = await _started_node(**arguments)
        node.configured_relay = None
        return node
    for start in range(1, RELAY_STARTS + 1):
        node = await _started_node(**arguments)
        node.configured_relay = await _configured_relay_answers(node, host)
        if node.configured_relay or start == RELAY_STARTS:
            break
        logger.info("relay: go-libp2p's default relay service answered, not the configured one; starting again")
        await node.shutdown()
    if not node.configured_relay:
        logger.warning("relay: go-libp2p's default relay service answered at each of %d starts: circuits through "
                       "this relay carry 128 KiB and last 2 minutes each", RELAY_STARTS)
    return node


def _loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("localhost", "::1")


async def _configured_relay_answers(node, host: str) -> bool:
    """swarm/relay_check.py's probe, which dials the relay where it listens, from this machine."""
    from swarm.relay_check import configured_service_answers

    port = next(text.split("/tcp/")[1].split("/")[0] for text in map(str, await node.get_visible_maddrs())
                if "/tcp/" in text)
    node.maddr = f"/ip4/{'127.0.0.1' if host == '0.0.0.0' else host}/tcp/{port}/p2p/{peer_id_of(node)}"
    return await configured_service_answers(node)


async def _started_node(initial_peers, host, port, identity_path, client_mode, relays, serve_relay, relay_limits,
                        announce_maddrs):
    from hivemind.dht.node import DHTNode

    from swarm import bounded_storage, trust
    from swarm.relays import RelayLimits, daemon_class, relay_options, relay_service_flags
    from swarm.transport import coalesce_small_writes

    coalesce_small_writes()  # before the node's P2P writes to its daemon: a server's and a client's messages alike
    client_mode = client_mode or bool(relays)  # a relayed node answers no DHT request: each would take the detour
    daemon = daemon_class(relay_service_flags(serve_relay, relay_limits or RelayLimits()))
    options = relay_options(relays, serve_relay)
    if announce_maddrs:
        options["announce_maddrs"] = list(announce_maddrs)
    with trust.identity(identity_path) as identity:
        p2p = await daemon.create(
            initial_peers=list(initial_peers),
            host_maddrs=[f"/ip4/{host}/tcp/{port}"],
            identity_path=identity.path,
            # hivemind asks the swarm whether an existing identity is in use already; a new one cannot be
            check_if_identity_free=not identity.created,
            dht_mode="client" if client_mode else "server",
            # the peer must be reachable on loopback and private networks alike: no UPnP on the router
            nat_port_map=False,
            **options,
        )
    try:
        node = await DHTNode.create(p2p=p2p, initial_peers=list(initial_peers), client_mode=client_mode,
                                    record_validator=trust.OwnerSignedRecords(identity.key))
    except BaseException:
        await p2p.shutdown()
        raise
    node._should_shutdown_p2p = True  # its daemon is the node's alone, as when hivemind starts it: it stops with it
    return bounded_storage.install(node)  # a key keeps at most what swarm/directory.py allows


async def visible_maddrs(node) -> list[str]:
    return [str(address) for address in await node.get_visible_maddrs()]


def peer_id_of(node) -> str:
    return node.peer_id.to_base58()


async def announce(node, prefix: str, info: ServerInfo, expiration: float) -> None:
    """Store the server's record once, under the key of the block its span starts at (swarm/directory.py),
    signed, under its owner subkey (so that only it can change the record, and readers know which peer wrote
    it); valid `expiration` seconds."""
    from hivemind.utils import get_dht_time

    from swarm.trust import owner_subkey

    await node.store(record_key(prefix, info), info.to_wire(), get_dht_time() + expiration,
                     subkey=owner_subkey(node))


async def announce_model(node, record: ModelRecord, expiration: float) -> None:
    """Add the model to the swarm's catalogue.

    Each server writes its own entry, signed under its owner subkey, rather than one shared entry per model:
    under a shared subkey any peer could replace a model's entry (send clients to other weights, or hide
    the model); under its own subkey a stranger can only add an entry, never change or remove a server's,
    and readers go with what most servers of a model say (see fetch_catalogue)."""
    from hivemind.utils import get_dht_time

    from swarm.trust import owner_subkey

    await node.store(CATALOGUE_KEY, record.to_wire(), get_dht_time() + expiration, subkey=owner_subkey(node))


async def fetch_catalogue(node, allowed: Collection[str] = ()) -> list[ModelRecord]:
    """Every model that servers announce (only servers in `allowed`, if given), one record per prefix: the
    one most servers announce, where they disagree."""
    entry = await node.get(CATALOGUE_KEY, latest=True)
    votes: Counter[ModelRecord] = Counter()
    for _, item in _signed_entries(entry, allowed):
        record = ModelRecord.from_wire(item.value)
        if record is not None:
            votes[record] += 1
    chosen: dict[str, ModelRecord] = {}
    for record, _ in votes.most_common():  # most servers first: the first record seen for a prefix wins
        chosen.setdefault(record.prefix, record)
    return sorted(chosen.values(), key=lambda record: record.name)


async def fetch_servers(node, prefix: str, num_blocks: int, allowed: Collection[str] = (),
                        until: Optional[int] = None) -> list[RemoteServer]:
    """Every online server that announced any block of the model, as it last described itself (only
    servers in `allowed`, if given); with `until`, only the keys of the servers that may hold the blocks before it
    (see fetch_all_servers)."""
    servers = await fetch_all_servers(node, prefix, num_blocks, allowed, until)
    return [server for server in servers if server.info.state == ServerState.ONLINE]


async def fetch_all_servers(node, prefix: str, num_blocks: int, allowed: Collection[str] = (),
                            until: Optional[int] = None) -> list[RemoteServer]:
    """Every server with an unexpired record of the model, joining and offline ones too (what a health page
    shows; routing wants fetch_servers); only servers in `allowed`, if given. With `until`, only the keys that
    hold the servers of the blocks before it (see swarm/directory.py): a server may hold later blocks too."""
    return await _newest_records(node, start_keys(prefix, num_blocks, until), num_blocks, allowed)


async def servers_of_block(node, prefix: str, block: int, allowed: Collection[str] = ()) -> set[str]:
    """Peer ids of the online servers whose newest record says they hold block `block` (only servers in `allowed`,
    if given): where a server may push a session's next step. Their records lie under the starts [0, block]."""
    servers = await _newest_records(node, start_keys(prefix, block + 1), None, allowed)
    return {server.peer_id for server in servers
            if server.info.state == ServerState.ONLINE and server.info.start <= block < server.info.end}


async def _newest_records(node, keys: list[str], num_blocks: Optional[int],
                          allowed: Collection[str]) -> list[RemoteServer]:
    """Each server's newest record under these keys (ignoring those past `num_blocks`, if given)."""
    # latest=True in effect: a cached record may be stale (a server that left), so always ask the swarm
    found = await node.get_many(keys, sufficient_expiration_time=float("inf"))
    latest: dict[str, tuple[float, RemoteServer]] = {}
    for key in keys:
        for peer_id, record in _signed_entries(found.get(key), allowed):
            info = ServerInfo.from_wire(record.value, num_blocks)  # None: malformed, insane, or past the model's end
            if info is None:
                continue
            # a server that moved left an OFFLINE record under its old start: its newest record says where it is
            # (and a server of the layout before this one left a record under each of its blocks)
            if peer_id not in latest or record.expiration_time > latest[peer_id][0]:
                latest[peer_id] = (record.expiration_time, RemoteServer(peer_id, info, record.expiration_time))
    return [server for _, server in latest.values()]


async def announce_region(node, region: str, expiration: float) -> None:
    """Say which region of the simulated network map this process is in (swarm/network_map.py): its own signed
    entry under REGIONS_KEY, which servers read to delay its messages by the link they cross."""
    from hivemind.utils import get_dht_time

    from swarm.network_map import REGIONS_KEY
    from swarm.trust import owner_subkey

    await node.store(REGIONS_KEY, region, get_dht_time() + expiration, subkey=owner_subkey(node))


async def fetch_regions(node) -> dict[str, str]:
    """peer id -> the region it announced (swarm/network_map.py), for every well-formed signed entry."""
    from swarm.network_map import REGIONS_KEY, region_of_wire

    entry = await node.get(REGIONS_KEY, latest=True)
    regions = {peer_id: region_of_wire(item.value) for peer_id, item in _signed_entries(entry)}
    return {peer_id: region for peer_id, region in regions.items() if region is not None}


def _signed_entries(entry, allowed: Collection[str] = ()):
    """(peer id of the writer, entry) for each entry of a dictionary value that its writer signed (see
    swarm/trust.py), at most what swarm/directory.py lets a key keep (several replicas, or nodes of older
    versions, may send back more); with `allowed`, only those written by these peers. Every other entry could
    be anyone's."""
    from hivemind.utils import get_dht_time

    from swarm.trust import owner_peer_id

    if entry is None or not isinstance(entry.value, dict):
        return
    signed = {subkey: (peer_id, item) for subkey, item in entry.value.items()
              if (peer_id := owner_peer_id(subkey)) is not None and (not allowed or peer_id in allowed)}
    keep = directory.kept((directory.Entry(subkey, item.value, item.expiration_time)
                           for subkey, (_, item) in signed.items()), get_dht_time())
    for subkey, (peer_id, item) in signed.items():
        if keep is None or subkey in keep:
            yield peer_id, item


# ------------------------------------------------------------------------------------------- process


async def _run_bootstrap_peer(args) -> None:
    import signal

    # the swarm's public entry point relays for servers behind a NAT (swarm/relays.py), unless told not to
    node = await start_node(host=args.host, port=args.port, identity_path=args.identity, serve_relay=args.relay,
                            relay_limits=args.relay_limits)
    print(" ".join(await visible_maddrs(node)), flush=True)  # the one line a script reads
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()
    await node.shutdown()


def main(argv=None) -> None:
    """`python -m swarm.dht`: a bootstrap peer; prints its multiaddr on one line of stdout, then serves."""
    import argparse

    from swarm.cli import ArgumentParser, run_main, setup_logging

    parser = ArgumentParser(prog="python -m swarm.dht", description=main.__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=0, help="TCP port (default: any free port)")
    parser.add_argument("--identity", help="a key file, created if missing, that keeps the peer id stable")
    parser.add_argument("--relay", action=argparse.BooleanOptionalAction, default=True,
                        help="relay for block servers that accept no inbound connection (--relay-through) "
                             "(default: on)")
    _add_relay_limit_flags(parser)
    args = parser.parse_args(argv)
    args.relay_limits = _relay_limits(parser, args)
    setup_logging()
    run_main(lambda: asyncio.run(_run_bootstrap_peer(args)))


def _add_relay_limit_flags(parser) -> None:
    from swarm.relays import RelayLimits

    default = RelayLimits()
    parser.add_argument("--relay-max-reservations", type=int, default=default.max_reservations,
                        help="relay slots in all, whoever takes them: p2pd cannot share them out per peer or "
                             "address, and counts a slot for 30 minutes even if its holder leaves "
                             f"(default: {default.max_reservations})")
    parser.add_argument("--relay-max-circuits", type=int, default=default.max_circuits,
                        help="relayed connections open at once from each peer, and to each "
                             f"(default: {default.max_circuits})")
    parser.add_argument("--relay-data-limit-mib", type=float, default=default.data_limit / 2**20,
                        help="MiB a relayed connection carries each way before the relay resets it "
                             f"(default: {default.data_limit / 2**20:g})")
    parser.add_argument("--relay-time-limit", type=float, default=default.time_limit,
                        help=f"seconds a relayed connection lasts before the relay resets it "
                             f"(default: {default.time_limit:g})")


def _relay_limits(parser, args):
    from swarm.relays import RelayLimits

    try:
        return RelayLimits(args.relay_max_reservations, args.relay_max_circuits,
                           int(args.relay_data_limit_mib * 2**20), args.relay_time_limit)
    except (ValueError, OverflowError) as error:  # NaN, inf, zero or less
        parser.error(f"--relay-* limits must be positive and finite: {error}")


if __name__ == "__main__":
    main()
