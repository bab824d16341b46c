"""A re-plan that must look up (the shared view has no server for a failed hop's blocks but banned ones) asks the
DHT only for the keys of the servers that may hold those blocks: records lie under a server's first block, so the
keys of blocks [0, end) (swarm/client/swarm_client.py, swarm/dht.py's `until`); the view, which keeps whole
lookups, is left as it was. The real SwarmClient's routing, the DHT lookup and rpc_info faked."""

import time

from swarm import dht
from swarm.protocol import RemoteServer, ServerInfo, ServerState
from test_dead_servers import client_over, rpc_info  # noqa: F401 (rpc_info: a fixture)


class CountedSwarm:
    """fetch_servers as the DHT answers it: whole, or only the servers whose first block is before `until`."""

    def __init__(self, *servers):
        self.servers, self.asked = list(servers), []

    async def fetch(self, node, prefix, num_blocks, allowed=(), until=None):
        self.asked.append(until)
        return [server for server in self.servers if until is None or server.info.start < until]


def online(peer: str, start: int, end: int) -> RemoteServer:
    return RemoteServer(peer, ServerInfo(ServerState.ONLINE, start, end, 100.0, 1024), time.time() + 60)


def test_a_replan_that_must_look_up_asks_only_for_the_keys_that_may_hold_its_blocks(rpc_info, monkeypatch):
    swarm = CountedSwarm(online("first", 0, 2), online("second", 2, 4))
    client = client_over(swarm, monkeypatch)
    monkeypatch.setattr(dht, "fetch_servers", swarm.fetch)
    try:
        assert [link.peer_id for link in client.chain("tiny", 4, "tiny", opening=True)] == ["first", "second"]
        assert swarm.asked == [None]  # the opening's: a whole lookup, into the view
        client.bans.ban("first", seconds=600)  # its step failed: the view holds no other server of blocks 0:2
        swarm.servers.append(online("replacement", 0, 3))  # joined since the view's lookup
        chain = client.chain("tiny", 4, "tiny", end=2, replan=True)
        assert [(link.peer_id, link.start, link.end) for link in chain] == [("replacement", 0, 2)]
        assert swarm.asked == [None, 2]  # only the keys of blocks 0 and 1
        assert "replacement" not in {server.peer_id for server in client.view.servers("tiny", 4, max_age=3600)}
    finally:
        client.probes.close()
        client.view.close()
