"""A client's connection to the swarm, and inference sessions over a chain of block servers.

Synchronous on the outside (the gateway's threads and the command-line tools call it), asynchronous inside:
every network call runs on the process's one event loop (see dht.EventLoop).
"""

from __future__ import annotations

import logging
from typing import Collection, Optional, Sequence

import torch

from swarm import dht
from swarm.protocol import CacheFullError, MissingBlocksError, RemoteServer, SessionLengthError
from swarm.routing import ChainLink, choose_chain
from swarm.rpc import InferenceStream, call_forward, call_info

logger = logging.getLogger(__name__)


class SwarmClient:
    """A client-mode DHT node: finds servers, builds chains and opens sessions."""

    def __init__(self, initial_peers: Sequence[str], timeout: float = 60.0):
        self.loop = dht.EventLoop.get()
        self.timeout = timeout  # for one step of one server
        self.node = self.loop.run(dht.start_node(initial_peers, client_mode=True))

    def servers(self, prefix: str, num_blocks: int) -> list[RemoteServer]:
        return self.loop.run(dht.fetch_servers(self.node, prefix, num_blocks))

    def chain(
        self, prefix: str, num_blocks: int, model_name: str, exclude: Collection[str] = (), end: Optional[int] = None
    ) -> list[ChainLink]:
        """The best chain over blocks [0, end) (default: all of them)."""
        servers = self.servers(prefix, num_blocks)
        return choose_chain(servers, num_blocks if end is None else end, model_name, exclude)

    def server_info(self, peer_id: str) -> dict:
        return self.loop.run(call_info(self.node.p2p, peer_id))

    def forward(self, chain: list[ChainLink], hidden: torch.Tensor) -> torch.Tensor:
        """A whole sequence through the chain, with no cache left behind: (batch, length, hidden) in and out."""

        async def run_chain():
            output = hidden
            for link in chain:
                output = await call_forward(self.node.p2p, link.peer_id, output, link.start, link.end, self.timeout)
            return output

        return self.loop.run(run_chain())

    def open_session(
        self, prefix: str, num_blocks: int, model_name: str, max_length: int, batch_size: int = 1
    ) -> "RemoteSession":
        """Open a session on the best chain; a server whose cache is full is routed around while others remain."""
        full: set[str] = set()
        while True:
            try:
                chain = self.chain(prefix, num_blocks, model_name, exclude=full)
            except MissingBlocksError:
                if full:  # only full servers could have served: that is the error worth reporting
                    raise CacheFullError(f"every server that could serve {model_name} has a full cache") from None
                raise
            try:
                return RemoteSession(self, chain, max_length, batch_size)
            except CacheFullError as error:
                logger.info("routing around a server with a full cache: %s", error)
                full.add(error.peer_id)

    def shutdown(self) -> None:
        self.loop.run(self.node.shutdown())


class RemoteSession:
    """Hidden states of new positions in, outputs of the last block out; each server keeps its cache."""

    def __init__(self, client: SwarmClient, chain: list[ChainLink], max_length: int, batch_size: int = 1):
        self.client, self.chain, self.max_length = client, chain, max_length
        self.position = 0  # tokens already in the servers' caches
        self.streams: list[InferenceStream] = []
        try:
            for link in chain:
                stream = InferenceStream(client.node.p2p, link.peer_id, link.start, link.end, client.timeout)
                self.streams.append(stream)
                client.loop.run(stream.open(max_length, batch_size))
        except CacheFullError as error:
            error.peer_id = link.peer_id  # lets the caller route around this one server
            self.close()
            raise
        except BaseException:
            self.close()
            raise

    def step(self, hidden: torch.Tensor, position: Optional[int] = None) -> torch.Tensor:
        """Run new positions (batch, length, hidden) through every server; `position` < current rewinds."""
        position = self.position if position is None else position
        end = position + hidden.shape[1]
        if end > self.max_length:
            raise SessionLengthError(
                f"session max_length exceeded: {end} tokens would not fit in max_length={self.max_length}"
            )

        async def run_chain():
            output = hidden
            for stream in self.streams:
                output = await stream.step(output, position)
            return output

        output = self.client.loop.run(run_chain())
        self.position = end
        return output

    def close(self) -> None:
        for stream in self.streams:
            self.client.loop.run(stream.close())
        self.streams = []

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
