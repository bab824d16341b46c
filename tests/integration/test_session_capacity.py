"""Real servers announce max_session_tokens (their --max-session-tokens, or less if their whole cache is smaller),
and SwarmClient.longest_session says the longest session the swarm can hold for a model."""

from shared_swarm import TINY_BLOCKS, TINY_PREFIX
from swarm.client import SwarmClient

PREFIX = "capacity"


def test_the_longest_session_comes_from_the_servers_records(tiny_swarm):
    small_cache = tiny_swarm.add_server(["--blocks", f"0:{TINY_BLOCKS}", "--dht-prefix", PREFIX, "--cache-tokens", "512"],
                                        wait=False)
    capped = tiny_swarm.add_server(["--blocks", f"0:{TINY_BLOCKS}", "--dht-prefix", PREFIX,
                                    "--max-session-tokens", "1024"], wait=False)
    client = SwarmClient(tiny_swarm.initial_peers)
    try:
        for server in (small_cache, capped):
            server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), 180)
        assert client.longest_session(TINY_PREFIX, TINY_BLOCKS) == 8192  # the default limit, under the default cache
        records = {server.peer_id: server.info.max_session_tokens for server in client.servers(PREFIX, TINY_BLOCKS)}
        assert records == {small_cache.peer_id: 512, capped.peer_id: 1024}
        assert client.longest_session(PREFIX, TINY_BLOCKS) == 1024  # the best server of every block
        capped.stop()  # withdrawn at once
        assert client.longest_session(PREFIX, TINY_BLOCKS) == 512
        small_cache.stop()
        assert client.longest_session(PREFIX, TINY_BLOCKS) is None  # no server: unknown
    finally:
        client.shutdown()
        for server in (small_cache, capped):
            server.stop()
