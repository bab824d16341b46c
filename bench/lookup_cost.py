"""What one lookup of a model's servers returns, in the DHT layout before issue 42 (a record under every block a
server holds) and in today's (one record per server, keys bounded: swarm/directory.py).

`python -m bench.lookup_cost [--servers 50] [--blocks 80] [--span 24] [--starts 0] [--nodes 3]`: real DHT nodes in this process
(full nodes that store, a client that writes as each simulated server's identity, a client that looks up); each
layout under a model prefix of its own. Prints, per layout, the records and protobuf bytes of the replies one lookup
(dht.fetch_all_servers: one get_many over every block's key) received, the servers it found, and its time.
"""

from __future__ import annotations

import argparse
import random
import time
import uuid


def announce_as_before(node, prefix: str, info, expiration: float):
    """What a server announced before issue 42: its record under every block it holds."""
    from hivemind.utils import get_dht_time

    from swarm.protocol import block_key
    from swarm.trust import owner_subkey

    keys = [block_key(prefix, block) for block in range(info.start, info.end)]
    return node.store_many(keys, [info.to_wire()] * len(keys), expiration_time=get_dht_time() + expiration,
                           subkeys=[owner_subkey(node)] * len(keys))


class ReplyBytes:
    """Counts the FindResponse bytes a node's lookups receive (its libp2p endpoint's protobuf calls, wrapped)."""

    def __init__(self, node):
        self.bytes = self.replies = 0
        call = node.p2p.call_protobuf_handler

        async def counted(peer, handle_name, request, response_type):
            response = await call(peer, handle_name, request, response_type)
            if handle_name.endswith("rpc_find"):
                self.bytes += response.ByteSize()
                self.replies += 1
            return response

        node.p2p.call_protobuf_handler = counted


def measure(args) -> None:
    from hivemind.dht.storage import DHTLocalStorage
    from hivemind.utils.crypto import RSAPrivateKey

    from swarm import bounded_storage, dht, trust
    from swarm.protocol import ServerInfo, ServerState

    loop = dht.EventLoop.get()
    first = loop.run(dht.start_node())
    peers = loop.run(dht.visible_maddrs(first))
    full = [first, *(loop.run(dht.start_node(peers)) for _ in range(args.nodes - 1))]
    writer, reader = (loop.run(dht.start_node(peers, client_mode=True)) for _ in range(2))
    rng = random.Random(0)
    starts = list(range(args.blocks - args.span + 1))
    if args.starts:  # servers tiling the model as placement would: a few starts, many servers at each
        starts = [round(index * (args.blocks - args.span) / max(args.starts - 1, 1)) for index in range(args.starts)]
    spans = [(start, start + args.span) for start in (rng.choice(starts) for _ in range(args.servers))]
    keys = [RSAPrivateKey() for _ in spans]
    counter = ReplyBytes(reader)
    try:
        for layout, announce in (("before: a record per block", announce_as_before), ("after: one per server", dht.announce)):
            prefix = f"cost-{uuid.uuid4().hex[:8]}"
            for node in full:  # before: hivemind's storage, which keeps whatever is written; after: bounded
                if announce is announce_as_before:
                    node.protocol.storage, node.protocol.cache = DHTLocalStorage(), DHTLocalStorage()
                else:
                    bounded_storage.install(node)
            for key, (start, end) in zip(keys, spans):
                writer.protocol.record_validator = trust.OwnerSignedRecords(key)
                info = ServerInfo(ServerState.ONLINE, start, end, rng.uniform(50, 500), rng.randint(0, 1 << 20))
                loop.run(announce(writer, prefix, info, 120))
            counter.bytes = counter.replies = 0
            began = time.perf_counter()
            found = loop.run(reader.get_many([f"{prefix}.{block}" for block in range(args.blocks)],
                                             sufficient_expiration_time=float("inf")))
            seconds = time.perf_counter() - began
            records = sum(len(entry.value) for entry in found.values() if entry is not None)
            reply_bytes, replies = counter.bytes, counter.replies
            servers = loop.run(dht.fetch_all_servers(reader, prefix, args.blocks))
            print(f"{layout}: {records} records, {reply_bytes / 1e3:.1f} kB in {replies} replies, "
                  f"{len(servers)} servers found, {seconds * 1e3:.0f} ms")
    finally:
        for node in [*full, writer, reader]:
            loop.run(node.shutdown())


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lookup_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=50)
    parser.add_argument("--blocks", type=int, default=80)
    parser.add_argument("--span", type=int, default=24)
    parser.add_argument("--starts", type=int, default=0,
                        help="distinct blocks the servers' spans start at (default: any; few: keys fill up)")
    parser.add_argument("--nodes", type=int, default=3, help="full DHT nodes that store the records")
    measure(parser.parse_args())


if __name__ == "__main__":
    main()
