"""A client's connection to the swarm, and inference sessions over a chain of block servers.

Synchronous on the outside (the gateway's threads and the command-line tools call it), asynchronous inside:
every network call runs on the process's one event loop (see dht.EventLoop).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Collection, Optional, Sequence

import torch

from swarm import dht
from swarm.cache import PAGE_TOKENS
from swarm.protocol import (
    CacheFullError,
    MissingBlocksError,
    NotAllowedError,
    RemoteServer,
    ServerUnavailableError,
    SessionLengthError,
)
from swarm.routing import ChainLink, choose_chain
from swarm.rpc import InferenceStream, call_forward, call_info
from swarm.spot_check import SpotChecker

logger = logging.getLogger(__name__)


class Bans:
    """Peers left out of routing for a while. A failure (dead, stalled, cut off) bans a peer for a time that
    doubles on each repeat, and routing still falls back on it when no other server holds its blocks; a peer
    caught answering wrong is distrusted: never routed to until its ban ends."""

    def __init__(self, base_seconds: float = 30.0, max_seconds: float = 600.0):
        self.base, self.max = base_seconds, max_seconds
        self._until: dict[str, float] = {}
        self._distrusted_until: dict[str, float] = {}
        self._strikes: dict[str, int] = {}
        self._lock = threading.Lock()

    def ban(self, peer_id: str, seconds: Optional[float] = None, distrust: bool = False) -> None:
        """Ban for `seconds`, or by default for the peer's strikes so far; a ban is never shortened."""
        with self._lock:
            strikes = self._strikes[peer_id] = self._strikes.get(peer_id, 0) + 1
            seconds = min(self.base * 2 ** (strikes - 1), self.max) if seconds is None else seconds
            for bans in (self._until, self._distrusted_until) if distrust else (self._until,):
                bans[peer_id] = max(bans.get(peer_id, 0.0), time.monotonic() + seconds)

    def current(self) -> set[str]:
        return self._live(self._until)

    def distrusted(self) -> set[str]:
        return self._live(self._distrusted_until)

    def _live(self, bans: dict[str, float]) -> set[str]:
        now = time.monotonic()
        with self._lock:
            return {peer for peer, until in bans.items() if until > now}


class PeerLoad:
    """The client's own view of each server's load: the sessions it has open there and its recent latency,
    so that new sessions spread over replicas instead of piling onto the first."""

    def __init__(self):
        self.sessions: dict[str, int] = {}
        self.latency: dict[str, float] = {}  # an exponential moving average of seconds per step
        self._lock = threading.Lock()

    def opened(self, peer_id: str, change: int = 1) -> None:
        with self._lock:
            self.sessions[peer_id] = max(self.sessions.get(peer_id, 0) + change, 0)

    def observed(self, peer_id: str, seconds: float) -> None:
        with self._lock:
            previous = self.latency.get(peer_id, seconds)
            self.latency[peer_id] = 0.8 * previous + 0.2 * seconds

    def factors(self) -> dict[str, float]:
        """Multipliers of each server's estimated time: more sessions and slower answers weigh more."""
        with self._lock:
            fastest = min(self.latency.values(), default=0.0)
            return {
                peer: (1.0 + self.sessions.get(peer, 0)) * (self.latency.get(peer, fastest) / fastest if fastest else 1.0)
                for peer in set(self.sessions) | set(self.latency)
            }


class SwarmClient:
    """A client-mode DHT node: finds servers, builds chains and opens sessions that survive server failures.

    `allowed_servers`: a private swarm's servers (peer ids), the only ones it routes to (empty: any server);
    `spot_check_rate`: the chance that a step is checked on other servers (swarm/spot_check.py; 0: never).
    Both default to the settings of config.SwarmSettings (ALLOWED_SERVERS, SPOT_CHECK_RATE), so that every
    client of a deployment (the gateway's too) follows them."""

    def __init__(self, initial_peers: Sequence[str], timeout: float = 60.0, step_timeout: float = 5.0,
                 max_retries: int = 5, wire_dtype: torch.dtype = torch.float32,
                 allowed_servers: Optional[Collection[str]] = None, spot_check_rate: Optional[float] = None):
        from config import SwarmSettings

        if allowed_servers is None or spot_check_rate is None:
            settings = SwarmSettings.from_env()
            allowed_servers = settings.allowed_servers if allowed_servers is None else allowed_servers
            spot_check_rate = settings.spot_check_rate if spot_check_rate is None else spot_check_rate
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
        self.loop.run(self.node.shutdown())


STEP_SECONDS_PER_TOKEN = 0.02


@dataclass(frozen=True)
class Route:
    """Which model a session runs: what it needs to find servers again after a failure."""

    prefix: str
    num_blocks: int
    model_name: str


@dataclass
class Hop:
    """One server of a session's chain, and every input it has been sent (to replay onto a replacement)."""

    link: ChainLink
    stream: InferenceStream
    inputs: Optional[torch.Tensor] = None  # (batch, positions so far, hidden)

    def record(self, hidden: torch.Tensor, position: int) -> None:
        kept = self.inputs[:, :position] if self.inputs is not None else hidden[:, :0]
        self.inputs = torch.cat([kept, hidden], dim=1)


class RemoteSession:
    """Hidden states of new positions in, outputs of the last block out; each server keeps its cache.

    When a server fails (dies, stalls, is cut off), the session bans it, finds other servers for its blocks,
    replays the inputs that server had received so that the new ones rebuild their caches, and goes on: the
    outputs are the same as without the failure. Retries are bounded, with backoff.
    """

    def __init__(self, client: SwarmClient, route: Route, max_length: int, batch_size: int = 1):
        self.client, self.route, self.max_length, self.batch_size = client, route, max_length, batch_size
        self.position = 0  # tokens already in the servers' caches
        self._steps = 0  # step ids: servers tell a pushed step from the client's copy of it by these
        self.hops: list[Hop] = []
        try:
            self.hops = self._open_hops(0, route.num_blocks)
        except BaseException:
            self.close()
            raise

    @property
    def chain(self) -> list[ChainLink]:
        return [hop.link for hop in self.hops]

    def step(self, hidden: torch.Tensor, position: Optional[int] = None) -> torch.Tensor:
        """Run new positions (batch, length, hidden) through every server; `position` < current rewinds."""
        position = self.position if position is None else position
        end = position + hidden.shape[1]
        if end > self.max_length:
            raise SessionLengthError(
                f"session max_length exceeded: {end} tokens would not fit in max_length={self.max_length}"
            )
        output, index = hidden.to(self.client.wire_dtype), 0
        self._steps += 1
        check = self.client.spot_checks.plan(self.route, self.chain)
        while index < len(self.hops):
            hop = self.hops[index]
            hop.record(output, position)
            following = self.hops[index + 1] if index + 1 < len(self.hops) else None
            try:
                hop_output = self._step_hop(hop, output, position, following)
                if check is not None and check.link == hop.link:
                    self.client.spot_checks.verify(check, hop.inputs, hop_output)  # raises if the hop lied
                output = hop_output
                index += 1
            # a lie or a failure; a full cache is no fault, but the session goes elsewhere all the same
            except (ServerUnavailableError, CacheFullError) as error:
                output, index = self._fail_over(index, error, output.shape[1])
        self.position = end
        return output.to(hidden.dtype)

    def _step_hop(self, hop: Hop, hidden: torch.Tensor, position: int, following: Optional[Hop] = None) -> torch.Tensor:
        """One server's step; it pushes its outputs on to `following`'s server (which then starts at once), and
        they come back here too: to be sent on anyway, and kept for a replay should `following` fail."""
        timeout = self.client.step_timeout + STEP_SECONDS_PER_TOKEN * hidden.shape[1]
        began = time.perf_counter()
        push_to = following.stream if following is not None else None
        output = self.client.loop.run(hop.stream.step(hidden, position, timeout, self._steps, push_to))
        self.client.load.observed(hop.link.peer_id, time.perf_counter() - began)
        return output

    def _fail_over(self, index: int, error: Exception, new_positions: int) -> tuple[torch.Tensor, int]:
        """Replace hop `index` by servers that hold its blocks, replaying its inputs; return the outputs for the
        newest positions and the index of the hop after the replacements."""
        from swarm import metrics

        failed = self.hops[index]
        start, end, inputs = failed.link.start, failed.link.end, failed.inputs
        logger.warning("server %s failed (%s); re-routing blocks %d:%d", failed.link.peer_id, error, start, end)
        metrics.FAILOVERS.inc()
        # a full cache is no fault: that server is only avoided, and keeps the session if no other can take it
        cache_full = isinstance(error, CacheFullError)
        if not cache_full:
            self.client.bans.ban(failed.link.peer_id)
        last_error: Exception = error
        for attempt in range(self.client.max_retries):
            if attempt:
                metrics.RETRIES.inc()
                time.sleep(min(0.5 * 2 ** (attempt - 1), 5.0))  # backoff: a replacement may still be starting
            try:
                replacement = self._open_hops(start, end, full={failed.link.peer_id} if cache_full else ())
            except MissingBlocksError as missing:
                last_error = missing
                continue
            try:
                outputs = self._replay(replacement, inputs)
            except ServerUnavailableError as replay_error:
                last_error = replay_error
                for hop in replacement:
                    self._close_hop(hop)
                continue
            self.hops[index : index + 1] = replacement
            self._close_hop(failed)
            return outputs[:, -new_positions:], index + len(replacement)
        raise last_error

    def _replay(self, hops: list[Hop], inputs: torch.Tensor) -> torch.Tensor:
        """Every input the failed server had received, through its replacements, from position 0."""
        hidden = inputs
        for hop in hops:
            hop.record(hidden, 0)
            try:
                hidden = self._step_hop(hop, hidden, 0)
            except ServerUnavailableError:
                self.client.bans.ban(hop.link.peer_id)
                raise
        return hidden

    def _open_hops(self, start: int, end: int, full: Collection[str] = ()) -> list[Hop]:
        """Streams to the best chain over blocks [start, end), around servers whose cache is `full` (and any
        found full or unreachable on the way)."""
        client, route = self.client, self.route
        full, unreachable = set(full), set()  # full: its cache (or a limit), or it does not serve us
        last_refusal = ""
        while True:
            try:
                # servers take cache a page at a time as the session grows: what matters is room for the first
                chain = client.chain(route.prefix, route.num_blocks, route.model_name, full | unreachable, end, start,
                                     min_cache_tokens=min(self.max_length, PAGE_TOKENS) * self.batch_size)
            except MissingBlocksError:
                if full:  # servers with a full cache could have served: that is the error worth reporting
                    raise CacheFullError(f"every server that could serve blocks {start}:{end} of "
                                         f"{route.model_name} has a full cache or failed{last_refusal}") from None
                raise
            hops: list[Hop] = []
            try:
                for link in chain:
                    stream = InferenceStream(client.node.p2p, link.peer_id, link.start, link.end, client.timeout)
                    hops.append(Hop(link, stream))
                    client.load.opened(link.peer_id)
                    client.loop.run(stream.open(self.max_length, self.batch_size))
                return hops
            except BaseException as error:
                for hop in hops:  # the servers already opened free their cache at once
                    self._close_hop(hop)
                # full, failing, or private (NotAllowedError: a server not for this client): go elsewhere
                if not isinstance(error, (CacheFullError, ServerUnavailableError, NotAllowedError)):
                    raise
                logger.info("routing around server %s: %s", link.peer_id, error)
                if isinstance(error, ServerUnavailableError):
                    unreachable.add(link.peer_id)
                    client.bans.ban(link.peer_id)
                else:
                    full.add(link.peer_id)
                    last_refusal = f" (the last one: {error})"

    def _close_hop(self, hop: Hop) -> None:
        self.client.load.opened(hop.link.peer_id, -1)
        self.client.loop.run(hop.stream.close())

    def close(self) -> None:
        for hop in self.hops:
            self._close_hop(hop)
        self.hops = []

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
