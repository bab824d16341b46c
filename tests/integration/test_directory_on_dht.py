"""The DHT layout on real DHT nodes (three full nodes and two client nodes, in this process): a server's record is
stored once, under the block its span starts at, and a lookup finds it for any block it holds; a key keeps at most
its bound, on the nodes that store it; a record of the layout before (one under every block) is still found; and
routing over what a lookup returns chooses the chains it chose over every server's record."""

import random
import uuid

import pytest

from swarm import directory, dht, trust
from swarm.client.routing import choose_chain
from swarm.protocol import RemoteServer, ServerInfo, ServerState, block_key

BLOCKS = 8


@pytest.fixture(scope="module")
def nodes():
    """(full nodes, a writer, a reader): the writer signs as whichever identity it is given (see as_identity)."""
    loop = dht.EventLoop.get()
    first = loop.run(dht.start_node())
    peers = loop.run(dht.visible_maddrs(first))
    full = [first, *(loop.run(dht.start_node(peers)) for _ in range(2))]
    writer, reader = (loop.run(dht.start_node(peers, client_mode=True)) for _ in range(2))
    yield full, writer, reader
    for node in [*full, writer, reader]:
        loop.run(node.shutdown())


@pytest.fixture(scope="module")
def identities():
    from hivemind.utils.crypto import RSAPrivateKey

    return [RSAPrivateKey() for _ in range(10)]


def as_identity(node, key) -> str:
    """Make the node sign as `key`'s owner (a server of its own, without a daemon of its own); its peer id."""
    node.protocol.record_validator = trust.OwnerSignedRecords(key)
    return trust.owner_peer_id(trust.owner_subkey(node))


def run(coroutine):
    return dht.EventLoop.get().run(coroutine)


def stored_under(node, prefix: str) -> dict[int, int]:
    """block -> entries a full node stores under that block's key."""
    from hivemind.dht.routing import DHTID

    counts = {}
    for block in range(BLOCKS):
        found = node.protocol.storage.get(DHTID.generate(block_key(prefix, block)))
        if found is not None:
            counts[block] = len(found.value)
    return counts


def test_a_record_is_stored_once_and_found_by_a_lookup_of_any_block_it_holds(nodes, identities):
    full, writer, reader = nodes
    prefix = f"once-{uuid.uuid4().hex[:8]}"
    peer = as_identity(writer, identities[0])
    info = ServerInfo(ServerState.ONLINE, 2, 5, 100.0, 4096)
    run(dht.announce(writer, prefix, info, expiration=60))
    assert {block for node in full for block in stored_under(node, prefix)} == {2}  # one key: its first block's
    assert [(server.peer_id, server.info) for server in run(dht.fetch_servers(reader, prefix, BLOCKS))] == [(peer, info)]
    for block in range(BLOCKS):
        holders = run(dht.servers_of_block(reader, prefix, block))
        assert holders == ({peer} if 2 <= block < 5 else set()), block


def test_a_key_keeps_at_most_its_bound_on_the_nodes_that_store_it(nodes, identities, monkeypatch):
    full, writer, reader = nodes
    monkeypatch.setattr(directory, "BEST_RECORDS_PER_KEY", 4)  # the full nodes are in this process: a small bound
    monkeypatch.setattr(directory, "SAMPLED_RECORDS_PER_KEY", 2)
    monkeypatch.setattr(directory, "RECORDS_PER_KEY", 6)
    prefix = f"bound-{uuid.uuid4().hex[:8]}"
    speeds = {}
    for index, key in enumerate(identities):  # ten servers starting at block 0, each faster than the last
        speeds[as_identity(writer, key)] = 10.0 * (index + 1)
        run(dht.announce(writer, prefix, ServerInfo(ServerState.ONLINE, 0, 3, 10.0 * (index + 1), 4096), 60))
    assert all(stored_under(node, prefix).get(0, 0) <= 6 for node in full)
    assert max(stored_under(node, prefix).get(0, 0) for node in full) == 6  # the key's nearest nodes filled it
    found = run(dht.fetch_servers(reader, prefix, BLOCKS))
    assert len(found) == 6
    fastest = sorted(speeds, key=speeds.get)[-4:]
    assert set(fastest) <= {server.peer_id for server in found}


def announce_as_before(node, prefix: str, info: ServerInfo):
    """What a server of the layout before this one announced: its record under every block it holds."""
    from hivemind.utils import get_dht_time

    keys = [block_key(prefix, block) for block in range(info.start, info.end)]
    return node.store_many(keys, [info.to_wire()] * len(keys), expiration_time=get_dht_time() + 60,
                           subkeys=[trust.owner_subkey(node)] * len(keys))


def random_swarm(rng: random.Random) -> list[ServerInfo]:
    spans = [(0, rng.randint(1, BLOCKS))]  # something covers block 0
    spans += [(start, rng.randint(start + 1, BLOCKS)) for start in (rng.randrange(BLOCKS) for _ in range(5))]
    spans.append((rng.randrange(BLOCKS), BLOCKS))  # and the last block
    return [ServerInfo(ServerState.ONLINE, start, end, rng.uniform(10, 1000), rng.choice([0, 4096, 1 << 20]))
            for start, end in spans]


def test_routing_over_a_lookup_chooses_the_chains_it_chose_before(nodes, identities):
    """Small random swarms, half of whose servers announce as before (every block) and half once: a lookup finds
    each server once, as it announced itself, and routing chooses the chain it chooses over all their records."""
    full, writer, reader = nodes
    rng = random.Random(7)
    for swarm in range(4):
        prefix = f"same-{swarm}-{uuid.uuid4().hex[:8]}"
        announced = {}
        for index, info in enumerate(random_swarm(rng)):
            peer = as_identity(writer, identities[index])
            announced[peer] = info
            run(announce_as_before(writer, prefix, info) if index % 2 else dht.announce(writer, prefix, info, 60))
        found = run(dht.fetch_servers(reader, prefix, BLOCKS))
        assert {server.peer_id: server.info for server in found} == announced
        truth = [RemoteServer(peer, info) for peer, info in announced.items()]
        for start in (0, 3):
            assert choose_chain(found, BLOCKS, "m", start=start) == choose_chain(truth, BLOCKS, "m", start=start)
