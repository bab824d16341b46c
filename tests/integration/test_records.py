"""Signed DHT records: a stranger in the tiny swarm tries to overwrite a server's record, to forge one under
the server's peer id, and to change the model catalogue; readers still see only what the servers wrote."""

import pytest

from shared_swarm import TINY_BLOCKS, TINY_PREFIX
from swarm import dht
from swarm.client import SwarmClient
from swarm.protocol import CATALOGUE_KEY, ModelRecord, ServerInfo, ServerState, block_key

FORGED = ServerInfo(ServerState.ONLINE, 0, TINY_BLOCKS, throughput=1e9, cache_tokens_free=1 << 30).to_wire()


def forger_class():
    """A validator that signs every record with its own key, whoever's subkey the record is under."""
    from hivemind.dht.crypto import RSASignatureValidator

    class Forger(RSASignatureValidator):
        def sign_value(self, record):
            signature = self._private_key.sign(self._serialize_record(record))
            return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)

    return Forger


@pytest.fixture(scope="module")
def forger(tiny_swarm, client):
    """A client-mode peer that signs what it stores with the wrong key (see forger_class)."""
    from hivemind.dht.node import DHTNode

    node = client.loop.run(DHTNode.create(initial_peers=tiny_swarm.initial_peers, client_mode=True,
                                          host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validator=forger_class()()))
    yield node
    client.loop.run(node.shutdown())


def announced(servers) -> dict:
    """What a forger would change, per peer: span, state, throughput and whether its cache is the forged size
    (a real server's free cache itself changes with every re-announcement, as other tests' sessions close)."""
    return {server.peer_id: (server.info.start, server.info.end, server.info.state, server.info.throughput,
                             server.info.cache_tokens_free == 1 << 30) for server in servers}


def real_servers(client) -> dict:  # what routing sees
    return announced(client.servers(TINY_PREFIX, TINY_BLOCKS))


def victim_subkey(client, victim: str, key: str):
    """The owner subkey the victim's record is stored under."""
    from swarm.trust import owner_peer_id

    entry = client.loop.run(client.node.get(key, latest=True))
    [subkey] = [subkey for subkey in entry.value if owner_peer_id(subkey) == victim]
    return subkey


def test_no_peer_can_overwrite_or_forge_a_servers_record(tiny_swarm, client, forger):
    from hivemind.utils import get_dht_time

    before = real_servers(client)
    victim = tiny_swarm.servers[0].peer_id
    key = block_key(TINY_PREFIX, 0)
    expiration = get_dht_time() + 300  # later than the real record's: it would win, were it accepted
    # the same key and subkey, signed by the wrong key; and the server's peer id as a subkey
    for subkey in (victim_subkey(client, victim, key), victim):
        assert not client.loop.run(forger.store(key, FORGED, expiration, subkey=subkey))  # every peer refused
    assert real_servers(client) == before


def test_a_stranger_can_sign_only_as_itself(client, forger):
    from hivemind.utils import get_dht_time

    from swarm.trust import owner_peer_id

    stranger = forger
    own_subkey = stranger.protocol.record_validator.local_public_key
    record = ServerInfo(ServerState.ONLINE, 0, 1, throughput=1.0, cache_tokens_free=1)
    assert client.loop.run(stranger.store(block_key("elsewhere", 0), record.to_wire(), get_dht_time() + 30,
                                          subkey=own_subkey))
    [server] = client.servers("elsewhere", 1)
    assert server.peer_id == owner_peer_id(own_subkey) and server.info == record  # the peer of the key that signed


def test_the_catalogue_keeps_what_the_servers_announce(client, forger):
    from hivemind.utils import get_dht_time

    [before] = [record for record in client.loop.run(dht.fetch_catalogue(client.node)) if record.prefix == TINY_PREFIX]
    hijack = ModelRecord(before.name, TINY_PREFIX, TINY_BLOCKS, source="/elsewhere/evil-weights").to_wire()
    stranger = forger
    expiration = get_dht_time() + 30
    for subkey in client.loop.run(client.node.get(CATALOGUE_KEY, latest=True)).value:  # each server's entry
        assert not client.loop.run(stranger.store(CATALOGUE_KEY, hijack, expiration, subkey=subkey))
    # its own entry is accepted, and outvoted by the servers of the model
    assert client.loop.run(stranger.store(CATALOGUE_KEY, hijack, expiration,
                                          subkey=stranger.protocol.record_validator.local_public_key))
    records = client.loop.run(dht.fetch_catalogue(client.node))
    assert [record for record in records if record.prefix == TINY_PREFIX] == [before]


def test_a_peer_that_serves_forged_records_is_not_believed(tiny_swarm, client):
    """A full DHT node without the validator keeps the forgery it stores, and sends it back to lookups: the
    client's validator drops what it sends."""
    from hivemind.dht.node import DHTNode
    from hivemind.dht.routing import DHTID
    from hivemind.utils import get_dht_time

    before = real_servers(client)
    key = block_key(TINY_PREFIX, 0)
    # its DHT id is the key's own: it is the nearest node to the key, so it keeps what is stored there and
    # every lookup asks it (otherwise which node keeps a key depends on the swarm's random ids)
    liar = client.loop.run(DHTNode.create(initial_peers=tiny_swarm.initial_peers, node_id=DHTID.generate(key),
                                          host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    try:
        subkey = victim_subkey(client, tiny_swarm.servers[0].peer_id, key)
        client.loop.run(liar.store(key, FORGED, get_dht_time() + 300, subkey=subkey))
        assert liar.protocol.storage.get(DHTID.generate(key)) is not None  # it kept the forgery
        assert real_servers(client) == before
        fresh = SwarmClient(tiny_swarm.initial_peers)  # one whose cache never held the real record
        try:
            assert announced(fresh.servers(TINY_PREFIX, TINY_BLOCKS)) == before
        finally:
            fresh.shutdown()
    finally:
        client.loop.run(liar.shutdown())


def test_no_peer_stores_a_record_of_many_kilobytes(client, forger):
    """A stranger's own record, rightly signed, but of 64 KiB: every peer refuses it (before: each stored it,
    and sent it back with every lookup of the block)."""
    from hivemind.utils import get_dht_time

    from swarm.trust import owner_peer_id

    stranger = forger
    own_subkey = stranger.protocol.record_validator.local_public_key
    bloated = {**ServerInfo(ServerState.ONLINE, 0, 1, throughput=1.0, cache_tokens_free=1).to_wire(),
               "padding": "x" * 65536}
    key = block_key("bloated", 0)
    assert not client.loop.run(stranger.store(key, bloated, get_dht_time() + 30, subkey=own_subkey))
    entry = client.loop.run(client.node.get(key, latest=True))
    assert entry is None or owner_peer_id(own_subkey) not in {owner_peer_id(subkey) for subkey in entry.value}
