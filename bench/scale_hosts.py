"""The DHT side of `python -m bench.scale`: real hivemind DHT nodes on 127.0.0.1 (each with its own libp2p
daemon, started by swarm.dht.start_node), holding the signed records of many simulated block servers.

A simulated server has its own RSA identity key, so its records are signed and validated as a real server's
are (swarm/trust.py), and readers take its peer id from its key, but it runs no libp2p daemon of its own: its
announce goes through one of the DHT nodes, whose validator holds the keys of the servers it hosts and signs each
record with the key its subkey names (ManyOwners). swarm.dht.announce is called as a server calls it, on a view of
the hosting node that names the simulated server's key as the node's own (SignedAs): whatever layout announce
writes (a record under each block, or one per server), the harness measures it. What a simulated server does not
do: answer DHT requests itself (a real server's node also stores other servers' records: the swarm here has the
hosts' 16 nodes, not N).

Every RPC a node sends is counted (RpcBytes): its protobuf request and reply bytes, without libp2p's framing and
encryption. The hosts run in a child process of their own (`serve`), so that the gateway's lookups in the parent
are timed against nodes that do not share its event loop.
"""

from __future__ import annotations

import asyncio
import pickle
import random
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

ANNOUNCES_AT_ONCE = 64  # simulated servers announcing at the same moment (a real swarm's are spread over a period)
RECORD_SECONDS = 600.0  # how long the simulated records live: longer than a run


class RpcBytes:
    """Protobuf bytes of the RPCs a node sends (requests) and gets back (replies), per RPC name."""

    def __init__(self):
        self.sent, self.received, self.calls, self.failed = Counter(), Counter(), Counter(), Counter()

    def install(self, node) -> "RpcBytes":
        original = node.protocol.get_stub
        node.protocol.get_stub = lambda peer: _CountingStub(original(peer), self)
        return self

    def snapshot(self) -> dict:
        return {"sent": dict(self.sent), "received": dict(self.received), "calls": dict(self.calls),
                "failed": dict(self.failed)}


class _CountingStub:
    def __init__(self, stub, counter: RpcBytes):
        self._stub, self._counter = stub, counter

    def __getattr__(self, name):
        method = getattr(self._stub, name)
        if not name.startswith("rpc_"):
            return method

        async def counted(request, *args, **kwargs):
            try:
                response = await method(request, *args, **kwargs)
            except BaseException:  # a reply over libp2p's message size, a timeout: hivemind goes on without it
                self._counter.failed[name] += 1
                raise
            self._counter.calls[name] += 1
            self._counter.sent[name] += request.ByteSize()
            self._counter.received[name] += response.ByteSize() if response is not None else 0
            return response

        return counted


def difference(after: dict, before: dict) -> dict:
    """What a counter snapshot added since another: {sent, received, calls, failed}, totals over the RPC names."""
    return {part: sum(after[part].values()) - sum(before[part].values())
            for part in ("sent", "received", "calls", "failed")}


def key_cache() -> Path:
    """Where the simulated servers' keys are kept between runs (making 9,000 takes minutes): the swarm's cache."""
    from config import SwarmSettings

    return SwarmSettings.from_env().cache_dir / "bench-scale-keys.pickle"


def load_keys(count: int, path: Optional[Path] = None) -> list:
    """`count` RSA identity keys (hivemind's RSAPrivateKey: 2048 bits, as every node's), the first ones kept in
    `path` across runs: generating one takes 30-60 ms of CPU, 10,000 several minutes."""
    from hivemind.utils.crypto import RSAPrivateKey

    path = path or key_cache()
    stored: list[bytes] = []
    if path.exists():
        with open(path, "rb") as file:
            stored = pickle.load(file)
    keys = []
    for data in stored[:count]:
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": data})
        keys.append(key)
    if len(keys) < count:
        keys += [RSAPrivateKey() for _ in range(count - len(keys))]
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as file:
            pickle.dump([key.to_bytes() for key in keys], file)
    return keys


def owner_validator(key):
    """The swarm's validator (swarm/trust.py) able to sign for many owners: see ManyOwners."""
    from swarm import trust

    class ManyOwners(trust.OwnerSignedRecords):
        """Validates as every node does; signs a record with the key whose owner marker its subkey holds (one of
        the simulated servers this node hosts), else as the node itself."""

        def __init__(self, private_key):
            super().__init__(private_key)
            self.owners: dict[bytes, trust.RSASignatureValidator] = {}

        def add(self, key) -> bytes:
            signer = trust.RSASignatureValidator(key)
            self.owners[signer.local_public_key] = signer
            return signer.local_public_key

        def sign_value(self, record):
            match = trust._OWNER_MARKER.search(record.subkey)
            signer = self.owners.get(match.group(0)) if match else None
            return signer.sign_value(record) if signer is not None else super().sign_value(record)

    return ManyOwners(key)


class SignedAs:
    """A hosting node as swarm.dht.announce sees it, with a simulated server's owner marker as its own: stores go
    through the real node, whose validator signs them with that server's key."""

    def __init__(self, node, marker: bytes):
        self._node = node
        self.protocol = SimpleNamespace(record_validator=SimpleNamespace(local_public_key=marker))

    def __getattr__(self, name):
        return getattr(self._node, name)


class Hosts:
    """The DHT nodes, and the simulated servers they host."""

    def __init__(self, nodes: list, validators: list, counters: list[RpcBytes]):
        self.nodes, self.validators, self.counters = nodes, validators, counters
        self.host_of: dict[bytes, int] = {}  # a simulated server's owner marker -> the node that signs for it

    @classmethod
    async def start(cls, count: int) -> "Hosts":
        from swarm.dht import start_node, visible_maddrs

        nodes = [await start_node()]
        first = await visible_maddrs(nodes[0])
        nodes += await asyncio.gather(*(start_node(initial_peers=first) for _ in range(count - 1)))
        validators = []
        for node in nodes:  # the node's own key stays its own: it signs as before
            validators.append(owner_validator(node.protocol.record_validator._private_key))
            node.protocol.record_validator = validators[-1]
        return cls(nodes, validators, [RpcBytes().install(node) for node in nodes])

    async def maddrs(self) -> list[str]:
        from swarm.dht import visible_maddrs

        return await visible_maddrs(self.nodes[0])

    async def announce(self, prefix: str, records: list, markers: list[bytes]) -> dict:
        """Announce each simulated server's ServerInfo once, through swarm.dht.announce: the time, and the RPC
        traffic of every node (replication's finds and stores included)."""
        from swarm.dht import announce

        before = [counter.snapshot() for counter in self.counters]
        limit = asyncio.Semaphore(ANNOUNCES_AT_ONCE)

        async def one(number: int):
            async with limit:
                host = self.nodes[self.host_of[markers[number]]]
                await announce(SignedAs(host, markers[number]), prefix, records[number], RECORD_SECONDS)

        began = time.perf_counter()
        await asyncio.gather(*(one(number) for number in range(len(records))))
        traffic = [difference(counter.snapshot(), old) for counter, old in zip(self.counters, before)]
        return {"servers": len(records), "seconds": time.perf_counter() - began,
                **{part: sum(each[part] for each in traffic) for part in ("sent", "received", "calls", "failed")}}

    def stored_keys(self) -> set:
        return {key for node in self.nodes for key, _ in node.protocol.storage.items()}

    def records_per_key(self, keys_before: set) -> list[int]:
        """How many records each DHT key stored since `keys_before` holds (the most any of its replicas holds)."""
        per_key: dict = {}
        for node in self.nodes:
            for key, stored in node.protocol.storage.items():
                if key not in keys_before:
                    count = len(stored.value) if hasattr(stored.value, "__len__") else 1
                    per_key[key] = max(per_key.get(key, 0), count)
        return sorted(per_key.values())

    async def stop(self) -> None:
        for node in self.nodes:
            await node.shutdown()


def serve(connection, node_count: int, key_cache: Optional[str]) -> None:
    """The child process: start the nodes, send their address, then answer ("announce", population, seed)
    with the announce's figures and the servers' truths, until ("stop",)."""
    from swarm.dht import EventLoop

    loop = EventLoop.get()
    hosts = loop.run(Hosts.start(node_count))
    connection.send(loop.run(hosts.maddrs()))
    while True:
        message = connection.recv()
        if message[0] == "stop":
            loop.run(hosts.stop())
            connection.send("stopped")
            return
        connection.send(_announce_population(loop, hosts, message[1], key_cache))


def _announce_population(loop, hosts: Hosts, options: dict, key_cache: Optional[str]):
    """Announce options["servers"] simulated servers in batches, until all are or options["budget"] seconds of
    announcing are spent: (figures, the servers announced)."""
    from bench.scale_population import population, records_of
    from swarm.trust import owner_peer_id

    began = time.perf_counter()
    keys = load_keys(options["servers"], Path(key_cache) if key_cache else None)
    markers = _assign(hosts, keys)
    servers = population([owner_peer_id(marker) for marker in markers], options, random.Random(options["seed"]))
    records = records_of(servers, options)
    figures = {"keys_seconds": time.perf_counter() - began, "batches": []}
    keys_before, batch = hosts.stored_keys(), max(len(servers) // 10, 10)
    done, spent = 0, 0.0
    while done < len(servers) and spent < options["budget"]:
        part = slice(done, done + batch)
        figures["batches"].append(loop.run(hosts.announce(options["prefix"], records[part], markers[part])))
        done, spent = done + len(records[part]), spent + figures["batches"][-1]["seconds"]
    figures["announced"] = done
    figures["records_per_key"] = hosts.records_per_key(keys_before)
    return figures, servers[:done]


def _assign(hosts: Hosts, keys: list) -> list[bytes]:
    """Each key to a hosting node (in turn), its owner marker returned."""
    markers = []
    for number, key in enumerate(keys):
        markers.append(hosts.validators[number % len(hosts.validators)].add(key))
        hosts.host_of[markers[-1]] = number % len(hosts.validators)
    return markers
