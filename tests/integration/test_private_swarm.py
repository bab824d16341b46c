"""A private swarm: clients route only to the servers of ALLOWED_SERVERS, and a server with --allowed-clients
serves only those clients (others route around it)."""

import pytest
import torch

from shared_swarm import TINY_BLOCKS, TINY_PREFIX
from config import SwarmSettings
from swarm import dht
from swarm.client import SwarmClient
from swarm.protocol import CacheFullError, MissingBlocksError, NotAllowedError


def test_a_client_routes_only_to_the_allowed_servers(tiny_swarm, monkeypatch):
    first, second = tiny_swarm.servers[:2]  # blocks 0:2 and 2:4
    monkeypatch.setenv("ALLOWED_SERVERS", first.peer_id)  # as a gateway's client is configured: config.py reads
    client = SwarmClient(tiny_swarm.initial_peers, allowed_servers=SwarmSettings.from_env().allowed_servers)  # it
    try:
        assert [server.peer_id for server in client.servers(TINY_PREFIX, TINY_BLOCKS)] == [first.peer_id]
        with pytest.raises(MissingBlocksError, match=r"blocks 2\.\.3"):
            client.chain(TINY_PREFIX, TINY_BLOCKS, "tiny")
        # the catalogue and the health page, too, see only what the allowed servers announce
        assert {record.prefix for record in client.catalogue()} == {TINY_PREFIX}
        assert [server.peer_id for server in client.health(TINY_PREFIX, TINY_BLOCKS).servers] == [first.peer_id]
    finally:
        client.shutdown()
    client = SwarmClient(tiny_swarm.initial_peers, allowed_servers=[first.peer_id, second.peer_id])
    try:
        chain = client.chain(TINY_PREFIX, TINY_BLOCKS, "tiny")
        assert [link.peer_id for link in chain] == [first.peer_id, second.peer_id]
    finally:
        client.shutdown()


def test_a_private_server_serves_only_its_clients(tiny_swarm):
    member, stranger = SwarmClient(tiny_swarm.initial_peers), SwarmClient(tiny_swarm.initial_peers)
    try:
        server = tiny_swarm.add_server(["--blocks", f"0:{TINY_BLOCKS}", "--dht-prefix", "private",
                                        "--allowed-clients", dht.peer_id_of(member.node)])
        with member.open_session("private", TINY_BLOCKS, "private", max_length=4) as session:
            assert session.step(torch.randn(1, 2, 64)).shape == (1, 2, 64)
        assert member.server_info(server.peer_id)["start"] == 0

        with pytest.raises(CacheFullError, match="not on this server's list of clients"):  # routed around: no other
            stranger.open_session("private", TINY_BLOCKS, "private", max_length=4)
        with pytest.raises(NotAllowedError):
            stranger.server_info(server.peer_id)
        with pytest.raises(NotAllowedError):
            stranger.forward(stranger.chain("private", TINY_BLOCKS, "private"), torch.randn(1, 2, 64))
    finally:
        member.shutdown()
        stranger.shutdown()
