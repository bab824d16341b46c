"""SwarmClient: a client's connection to the swarm, and what the swarm looks like from it.

Synchronous on the outside (the gateway's threads and the command-line tools call it), asynchronous inside:
every network call runs on the process's one event loop (see dht.EventLoop). Its answers about the swarm
(catalogue, coverage, health) are dataclasses: callers never touch the DHT themselves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Collection, Optional, Sequence

import torch

from swarm import dht
from swarm.client.peers import Bans, PeerLoad
from swarm.client.routing import ChainLink, choose_chain
from swarm.client.remote_session import RemoteSession, Route
from swarm.client.spot_check import SpotChecker
from swarm.client.stubs import StepChannels, call_forward, call_info
from swarm.protocol import (
    MissingBlocksError,
    ModelRecord,
    RemoteServer,
    ServerState,
    format_block_ranges,
    missing_ranges,
    servers_per_block,
)

logger = logging.getLogger(__name__)


class _MissingBlocks:
    """What Coverage and SwarmHealth say of their `missing` block ranges."""

    missing: list[tuple[int, int]]

    @property
    def covered(self) -> bool:
        return not self.missing

    @property
    def missing_blocks(self) -> Optional[str]:
        return format_block_ranges(self.missing) if self.missing else None


@dataclass(frozen=True)
class Coverage(_MissingBlocks):
    """Whether the swarm's online servers hold every block of a model."""

    num_blocks: int
    servers: int  # online servers of the model this client may route to
    missing: list[tuple[int, int]]  # half-open ranges of blocks no server holds


@dataclass(frozen=True)
class SwarmHealth(_MissingBlocks):
    """Every server that announced a block of a model (joining and offline ones too), sorted by span, and how
    many online servers hold each block."""

    num_blocks: int
    servers: list[RemoteServer]
    servers_per_block: list[int]
    missing: list[tuple[int, int]]  # blocks no online server holds


class SwarmClient:
    """A client-mode DHT node: finds servers, builds chains and opens sessions that survive server failures.

    `allowed_servers`: a private swarm's servers (peer ids), the only ones it routes to (empty: any server);
    `spot_check_rate`: the chance that a step is checked on other servers (swarm/client/spot_check.py; 0: never).
    Callers pass them from config.SwarmSettings (ALLOWED_SERVERS, SPOT_CHECK_RATE), so that every client of a
    deployment (the gateway's too) follows them."""

    def __init__(self, initial_peers: Sequence[str], timeout: float = 60.0, step_timeout: float = 5.0,
                 max_retries: int = 5, wire_dtype: torch.dtype = torch.float32,
                 allowed_servers: Collection[str] = (), spot_check_rate: float = 0.0):
        self.allowed_servers = frozenset(allowed_servers)
        self.spot_checks = SpotChecker(self, spot_check_rate)
        self.loop = dht.EventLoop.get()
        # hidden states travel in this dtype (bfloat16 or float16 halve the bytes; float32 keeps outputs exact)
        self.wire_dtype = wire_dtype
        self.timeout = timeout  # for a whole-sequence forward, or opening a stream
        # a step may take this long, plus STEP_SECONDS_PER_TOKEN for each position it carries; a server that
        # stays silent longer (dead, stalled, cut off) is banned and its span re-routed
        self.step_timeout, self.max_retries = step_timeout, max_retries
        self.bans, self.load = Bans(), PeerLoad()
        self.node = self.loop.run(dht.start_node(initial_peers, client_mode=True))
        # the steps of all this client's sessions on one server travel together (swarm/client/stubs.py)
        self.step_channels = StepChannels(self.node.p2p, timeout)

    def servers(self, prefix: str, num_blocks: int) -> list[RemoteServer]:
        """The online servers of a model that this client may route to."""
        return self.loop.run(dht.fetch_servers(self.node, prefix, num_blocks, self.allowed_servers))

    def chain(
        self, prefix: str, num_blocks: int, model_name: str, exclude: Collection[str] = (), end: Optional[int] = None,
        start: int = 0, min_cache_tokens: int = 0,
    ) -> list[ChainLink]:
        """The best chain over blocks [start, end) (default: all of them), around banned and excluded peers."""
        servers, end = self.servers(prefix, num_blocks), num_blocks if end is None else end
        try:
            return choose_chain(servers, end, model_name, {*exclude, *self.bans.current()}, start,
                                self.load.factors(), min_cache_tokens)
        except MissingBlocksError:
            if not self.bans.current() - self.bans.distrusted():
                raise
            # only banned servers hold some of the blocks: a ban for a failure steers toward others, it must
            # not strand a session when there are none (a server that was only slow under a burst of load)
            return choose_chain(servers, end, model_name, {*exclude, *self.bans.distrusted()}, start,
                                self.load.factors(), min_cache_tokens)

    def catalogue(self) -> list[ModelRecord]:
        """The models the swarm's servers announce (one record per model, as most of its servers sign it)."""
        return self.loop.run(dht.fetch_catalogue(self.node, self.allowed_servers), timeout=10)

    def coverage(self, prefix: str, num_blocks: int) -> Coverage:
        servers = self.servers(prefix, num_blocks)
        return Coverage(num_blocks, len(servers), missing_ranges(servers, num_blocks))

    def health(self, prefix: str, num_blocks: int) -> SwarmHealth:
        servers = self.loop.run(dht.fetch_all_servers(self.node, prefix, num_blocks, self.allowed_servers))
        servers.sort(key=lambda server: (server.info.start, server.info.end, server.peer_id))
        online = [server for server in servers if server.info.state == ServerState.ONLINE]
        return SwarmHealth(num_blocks, servers, servers_per_block(online, num_blocks),
                           missing_ranges(online, num_blocks))

    def server_info(self, peer_id: str) -> dict:
        return self.loop.run(call_info(self.node.p2p, peer_id))

    def forward(self, chain: list[ChainLink], hidden: torch.Tensor) -> torch.Tensor:
        """A whole sequence through the chain, with no cache left behind: (batch, length, hidden) in and out."""

        async def run_chain():
            output = hidden.to(self.wire_dtype)
            for link in chain:
                output = await call_forward(self.node.p2p, link.peer_id, output, link.start, link.end, self.timeout)
            return output

        return self.loop.run(run_chain()).to(hidden.dtype)

    def open_session(
        self, prefix: str, num_blocks: int, model_name: str, max_length: int, batch_size: int = 1
    ) -> "RemoteSession":
        return RemoteSession(self, Route(prefix, num_blocks, model_name), max_length, batch_size)

    def shutdown(self) -> None:
        self.loop.run(self.step_channels.close())
        self.loop.run(self.node.shutdown())
