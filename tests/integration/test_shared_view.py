"""A client's sessions share one view of a model's servers (swarm/client/swarm_view.py): on two real replicas of
the tiny model's blocks, a second session opens from the view its first looked up, and a failover (a replica
killed mid-session) re-plans from it, with no DHT lookup of its own."""

import signal

import pytest

from swarm import dht
from swarm.client import SwarmClient
from swarm.client.remote_model import RemoteModel

PREFIX = "shared-view"
PROMPT = [5, 17, 42, 99]


@pytest.fixture(scope="module")
def replicas(tiny_swarm):
    """Two servers of all four blocks under a prefix of this module's own (they stop with the module)."""
    servers = [tiny_swarm.add_server(["--blocks", "0:4", "--dht-prefix", PREFIX], wait=False) for _ in range(2)]
    for server in servers:
        server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), 120)
    return servers


@pytest.fixture
def lookups(monkeypatch) -> list[str]:
    """The prefix of every lookup of a model's servers that a client makes (SwarmClient looks up through
    dht.fetch_servers)."""
    asked, real = [], dht.fetch_servers

    async def counted(node, prefix, *args, **kwargs):
        asked.append(prefix)
        return await real(node, prefix, *args, **kwargs)

    monkeypatch.setattr(dht, "fetch_servers", counted)
    return asked


def test_sessions_share_one_lookup_and_a_failover_makes_none(tiny_swarm, tiny_llama, replicas, lookups):
    client = SwarmClient(tiny_swarm.initial_peers, step_timeout=1.5)
    # no background refresh here: each lookup counted is one a caller made, and openings accept the view as old as
    # its refresh period (an hour here: a loaded machine's pace decides nothing); re-plans accept what they accept
    # in use (a record's life)
    client.view.refresh_seconds = 3600
    model = RemoteModel(tiny_llama, client, str(tiny_llama), PREFIX)
    try:
        with model.session(max_length=16) as first:
            first.step([PROMPT])
            looked_up = lookups.count(PREFIX)  # (other clients of this process look up other models meanwhile)
            assert looked_up >= 1
            with model.session(max_length=16) as second:
                second.step([PROMPT])
            assert lookups.count(PREFIX) == looked_up  # the second session opened from the first one's view
            [link] = first.blocks.chain
            victim = next(server for server in replicas if server.peer_id == link.peer_id)
            victim.process.send_signal(signal.SIGKILL)
            first.step([[1]])  # the step fails there, is banned, and re-planned onto the other replica
            assert [hop.peer_id for hop in first.blocks.chain] != [link.peer_id]
            assert lookups.count(PREFIX) == looked_up  # the failover made no lookup
    finally:
        model.close()
