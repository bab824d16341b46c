"""A real server sized for its box (no --blocks, no --num-blocks: as many blocks as --memory-budget fits) behind a
forwarded port (--public-address): the span it announces, its ready line, and a new client reaching it through the
forwarded port, the only address the swarm learns. The arithmetic: tests/unit/test_server_sizing.py."""

import socket
import threading

import pytest
import torch

from processes import free_port
from shared_swarm import TINY_BLOCKS

PREFIX = "tiny-sized"
CACHE_TOKENS, BATCH_TOKENS = 1024, 64


class ForwardedPort:
    """A router's forwarded port on loopback: every connection to `port` is piped to `target`, and counted."""

    def __init__(self, target: int):
        self.target, self.connections = target, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inside, _ = self.listener.accept()
                outside = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return  # closed
            self.connections += 1
            for source, sink in ((inside, outside), (outside, inside)):
                threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        self.listener.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            end.close()  # either side gone: the connection is over


@pytest.fixture(scope="module")
def sized_server(tiny_swarm, tiny_llama):
    """A server given the memory of 3.5 of the tiny model's blocks (after its working memory), listening on one
    port and reached through another."""
    from swarm.server.sizing import GIB, fit_blocks
    from swarm.weights import load_config

    parts = fit_blocks(load_config(tiny_llama), torch.float32, None, CACHE_TOKENS, BATCH_TOKENS, GIB, "test")
    budget = parts.working_bytes + 3.5 * (parts.weight_bytes + parts.cache_bytes)
    port = free_port()
    forwarded = ForwardedPort(port)
    server = tiny_swarm.add_server(["--dht-prefix", PREFIX, "--memory-budget", repr(budget / GIB),
                                    "--cache-tokens", str(CACHE_TOKENS), "--max-batch-tokens", str(BATCH_TOKENS),
                                    "--port", str(port), "--public-address", f"127.0.0.1:{forwarded.port}"])
    yield server, port, forwarded
    server.stop()
    forwarded.close()


def test_a_server_without_a_span_holds_what_its_memory_fits(sized_server, tiny_swarm):
    from swarm.client import SwarmClient

    server, _, _ = sized_server
    assert f"ready: blocks 0:3 of {PREFIX} " in server.ready_line
    assert "holds 3 blocks: 3 fit its memory (--memory-budget, " in server.ready_line
    client = SwarmClient(tiny_swarm.initial_peers)
    try:
        announced = client.servers(PREFIX, TINY_BLOCKS)
    finally:
        client.shutdown()
    assert [(found.peer_id, found.info.start, found.info.end) for found in announced] == [(server.peer_id, 0, 3)]


def test_clients_dial_the_public_address(sized_server, tiny_swarm):
    from swarm.client import SwarmClient

    server, port, forwarded = sized_server
    assert f"announced at /ip4/127.0.0.1/tcp/{forwarded.port}/p2p/{server.peer_id}" in server.ready_line
    assert f"/tcp/{port}/" not in server.ready_line  # the port it listens on is nobody's to dial
    before = forwarded.connections
    client = SwarmClient(tiny_swarm.initial_peers)  # a new peer: it learns the server's address from the swarm
    try:
        info = client.server_info(server.peer_id)
    finally:
        client.shutdown()
    assert (info["start"], info["end"]) == (0, 3)
    assert forwarded.connections > before
