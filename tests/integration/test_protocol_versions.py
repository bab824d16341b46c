"""Servers of several protocol versions in one swarm (an operator upgrading one server at a time): a client routes
only through servers whose protocol it speaks (the same major.minor), and its health view lists the others, which
the swarm page marks as not routed to. Two real DHT peers of the tiny swarm announce real signed records under a
model prefix of this test's own: one of today's protocol, one of 0.5.0 (neither serves blocks: routing would probe
them and find them dead, so the test asks what the client routes over, not for a chain)."""

import time
import uuid

import pytest

from swarm import dht
from swarm.protocol import PROTOCOL_VERSION, ServerInfo, ServerState

BLOCKS = 4


@pytest.fixture(scope="module")
def announced(tiny_swarm, client):
    """(prefix, upgraded peer id, lagging peer id): an upgraded server of blocks 0..1, a lagging one of 0..3."""
    prefix = f"versions-{uuid.uuid4().hex[:8]}"  # no other test's model: nobody else routes here
    nodes = [client.loop.run(dht.start_node(tiny_swarm.initial_peers, client_mode=True)) for _ in range(2)]
    records = [ServerInfo(ServerState.ONLINE, 0, 2, 100.0, 4096),
               ServerInfo(ServerState.ONLINE, 0, BLOCKS, 1000.0, 4096, version="0.5.0")]
    peers = [dht.peer_id_of(node) for node in nodes]
    deadline = time.monotonic() + 30
    while True:  # announced again until both records are found, as servers announce every period (a store to a
        for node, info in zip(nodes, records):  # key's replicas may time out on a loaded machine)
            client.loop.run(dht.announce(node, prefix, info, expiration=120))
        if {server.peer_id for server in client.health(prefix, BLOCKS).servers} == set(peers):
            break
        assert time.monotonic() < deadline, "the two records were never both found"
        time.sleep(1)
    yield prefix, *peers
    for node in nodes:
        client.loop.run(node.shutdown())


def test_routing_skips_servers_of_another_protocol_and_health_shows_them(client, announced):
    prefix, upgraded, lagging = announced
    assert [server.peer_id for server in client.servers(prefix, BLOCKS)] == [upgraded]
    # the lagging server alone holds blocks 2..3 (and claims to be faster): routing has no chain over them
    assert client.coverage(prefix, BLOCKS).missing == [(2, 4)]
    health = client.health(prefix, BLOCKS)
    assert {server.peer_id: server.info.version for server in health.servers} == {upgraded: PROTOCOL_VERSION,
                                                                                  lagging: "0.5.0"}
    assert health.servers_per_block == [1, 1, 0, 0] and health.missing == [(2, 4)]
