"""Load balancing: servers started with --num-blocks cover the model without gaps or duplicates, and a server
moves to a span nobody serves, loading only the blocks it lacked, and then stays."""

import time

from swarm.client import SwarmClient
from swarm.local import LocalSwarm


def spans(client, prefix, num_blocks=4):
    return sorted((server.info.start, server.info.end) for server in client.servers(prefix, num_blocks))


def test_four_servers_started_at_once_cover_every_block_once(tiny_llama, tmp_path):
    swarm = LocalSwarm(str(tiny_llama), [], log_dir=tmp_path).start()
    try:
        servers = [swarm.add_server(["--num-blocks", "1", "--dht-prefix", "split"], wait=False) for _ in range(4)]
        for server in servers:
            server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), 120)
        client = SwarmClient(swarm.initial_peers)
        try:
            assert spans(client, "split") == [(0, 1), (1, 2), (2, 3), (3, 4)]
        finally:
            client.shutdown()
    finally:
        swarm.stop()


def test_a_redundant_server_moves_to_a_gap_and_stays(tiny_llama, tmp_path):
    with LocalSwarm(str(tiny_llama), [], log_dir=tmp_path) as swarm:
        args = ["--dht-prefix", "uneven", "--announce-period", "1", "--rebalance-period", "2"]
        swarm.add_server(["--blocks", "0:2", *args])
        swarm.add_server(["--blocks", "0:2", *args])
        client = SwarmClient(swarm.initial_peers)
        try:
            deadline = time.monotonic() + 60
            while spans(client, "uneven") != [(0, 2), (2, 4)] and time.monotonic() < deadline:
                time.sleep(0.5)
            assert spans(client, "uneven") == [(0, 2), (2, 4)]
            mover = next(server for server in client.servers("uneven", 4) if server.info.start == 2)
            loaded = client.server_info(mover.peer_id)["loaded_names"]
            assert {int(name.split(".")[2]) for name in loaded} == {2, 3}  # it dropped 0..1 and loaded 2..3 only
            time.sleep(6)  # several rebalance periods: a balanced swarm stays as it is
            assert spans(client, "uneven") == [(0, 2), (2, 4)]
        finally:
            client.shutdown()
