"""Signed DHT records: a stranger in the tiny swarm tries to overwrite a server's record, to forge one under
the server's peer id, and to change the model catalogue; readers still see only what the servers wrote."""

import pytest

from conftest import TINY_BLOCKS, TINY_PREFIX
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
def reader(tiny_swarm):
    client = SwarmClient(tiny_swarm.initial_peers)
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def strangers(tiny_swarm, reader):
    """Two peers that do not play by the swarm's rules: a full DHT node with no validator (it keeps whatever
    it is sent, and serves it back), and a client-mode node whose validator signs anything with its own key."""
    from hivemind.dht.node import DHTNode

    async def start(**options):
        return await DHTNode.create(initial_peers=tiny_swarm.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                    **options)

    run = reader.loop.run
    nodes = [run(start()), run(start(client_mode=True, record_validator=forger_class()()))]
    yield nodes
    for node in nodes:
        run(node.shutdown())


def real_servers(reader) -> dict[str, ServerInfo]:  # what routing sees
    return {server.peer_id: server.info for server in reader.servers(TINY_PREFIX, TINY_BLOCKS)}


def test_no_peer_can_overwrite_or_forge_a_servers_record(tiny_swarm, reader, strangers):
    from hivemind.utils import get_dht_time

    from swarm.trust import owner_peer_id

    before = real_servers(reader)
    victim = tiny_swarm.servers[0].peer_id
    assert victim in before
    key = block_key(TINY_PREFIX, 0)
    subkeys = lambda: set(reader.loop.run(reader.node.get(key, latest=True)).value)
    [owner_subkey] = [subkey for subkey in subkeys() if owner_peer_id(subkey) == victim]
    expiration = get_dht_time() + 300  # later than the real record's: it would win, were it accepted

    for stranger in strangers:
        # the same key and subkey (unsigned, or signed by the wrong key), and the server's peer id as a subkey
        for subkey in (owner_subkey, victim):
            stored = reader.loop.run(stranger.store(key, FORGED, expiration, subkey=subkey))
            if stranger.protocol.client_mode:  # the full node keeps its own forgery; every other peer refused it
                assert not stored
    assert real_servers(reader) == before
    assert victim not in subkeys() and owner_subkey in subkeys()


def test_a_stranger_can_sign_only_as_itself(reader, strangers):
    from hivemind.utils import get_dht_time

    from swarm.trust import owner_peer_id

    stranger = strangers[1]
    own_subkey = stranger.protocol.record_validator.local_public_key
    record = ServerInfo(ServerState.ONLINE, 0, 1, throughput=1.0, cache_tokens_free=1)
    assert reader.loop.run(stranger.store(block_key("elsewhere", 0), record.to_wire(), get_dht_time() + 30,
                                          subkey=own_subkey))
    [server] = reader.servers("elsewhere", 1)
    assert server.peer_id == owner_peer_id(own_subkey) and server.info == record  # the peer of the key that signed


def test_the_catalogue_keeps_what_the_servers_announce(reader, strangers):
    from hivemind.utils import get_dht_time

    [before] = [record for record in reader.loop.run(dht.fetch_catalogue(reader.node)) if record.prefix == TINY_PREFIX]
    hijack = ModelRecord(before.name, TINY_PREFIX, TINY_BLOCKS, source="/elsewhere/evil-weights").to_wire()
    stranger = strangers[1]
    expiration = get_dht_time() + 30
    for subkey in reader.loop.run(reader.node.get(CATALOGUE_KEY, latest=True)).value:  # each server's entry
        assert not reader.loop.run(stranger.store(CATALOGUE_KEY, hijack, expiration, subkey=subkey))
    # its own entry is accepted, and outvoted by the servers of the model
    assert reader.loop.run(stranger.store(CATALOGUE_KEY, hijack, expiration,
                                          subkey=stranger.protocol.record_validator.local_public_key))
    records = reader.loop.run(dht.fetch_catalogue(reader.node))
    assert [record for record in records if record.prefix == TINY_PREFIX] == [before]
