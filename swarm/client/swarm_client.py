"""SwarmClient: a client's connection to the swarm, and what the swarm looks like from it.

Synchronous on the outside (the gateway's threads and the command-line tools call it), asynchronous inside:
every network call runs on the process's one event loop (see dht.EventLoop). Its answers about the swarm
(catalogue, coverage, health) are dataclasses: callers never touch the DHT themselves.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Optional, Sequence

import torch

from swarm import dht
from swarm.client import metrics
from swarm.client.peers import Bans, DeadPeers, PeerLoad
from swarm.client.probes import RoundTripProbes
from swarm.client.routing import (MAX_ADAPTERS_PER_MODEL, ChainLink, announced_adapters, choose_chain, longest_session,
                                  speaks)
from swarm.client.remote_session import RemoteSession
from swarm.client.swarm_view import REPLAN_MAX_AGE, SwarmView
from swarm.client.services import ClientServices, Route
from swarm.client.audits import Auditor
from swarm.client.spot_check import SpotChecker
from swarm.client.flowing import flowing_by_default
from swarm.client.forwards import forward_on
from swarm.client.stubs import StepChannels, call_info
from swarm.network_map import parse_region
from swarm.protocol import (PROTOCOL_VERSION, CacheFullError, InternalServerError, MissingBlocksError, ModelRecord,
                            RemoteServer, ServerState, ServerUnavailableError, format_block_ranges, missing_ranges,
                            servers_per_block)

logger = logging.getLogger(__name__)

BLOCK_POLL_SECONDS = 1.0  # while waiting for a server to hold missing blocks, the swarm is asked this often
MAX_ROUND_TRIP_ALLOWANCE = 10.0  # the most seconds measured round trips add to a session's step timeout
REGION_TTL = 3600.0  # seconds a client's announced region (a simulated network map's) lives in the DHT


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
    """Every server that announced a block of a model (joining and offline ones too, and those of a protocol this
    client does not speak), sorted by span, and how many online servers it may route to hold each block."""

    num_blocks: int
    servers: list[RemoteServer]
    servers_per_block: list[int]
    missing: list[tuple[int, int]]  # blocks no online server holds
    # seconds there and back, to the online servers measured (none to a server banned: it did not answer)
    round_trips: dict[str, float] = field(default_factory=dict)
    caught_lying: set[str] = field(default_factory=set)  # distrusted: an audit or a check caught them


class SwarmClient:
    """A client-mode DHT node: finds servers, builds chains and opens sessions that survive server failures.

    `allowed_servers`: a private swarm's servers (peer ids), the only ones it routes to (empty: any server);
    `spot_check_rate`: the chance that a step is checked on other servers (swarm/client/spot_check.py; 0: never);
    `audit_rate`: the chance that each hop of an ended session is recomputed elsewhere (swarm/client/audits.py);
    `block_wait`: how long a session or a request waits when no server holds some of its blocks (servers
    restarting, a replica reloading), before it fails with MissingBlocksError (0: it fails at once).
    Callers pass them from config.SwarmSettings (ALLOWED_SERVERS, SPOT_CHECK_RATE, AUDIT_RATE, BLOCK_WAIT_SECONDS),
    so that every client of a deployment (the gateway's too) follows them."""

    def __init__(self, initial_peers: Sequence[str], timeout: float = 60.0, step_timeout: float = 5.0,
                 max_retries: int = 5, wire_dtype: torch.dtype = torch.float32,
                 allowed_servers: Collection[str] = (), spot_check_rate: float = 0.0, audit_rate: float = 0.0,
                 block_wait: float = 0.0, region: Optional[str] = None):
        # a simulated network map's region (swarm/network_map.py), announced so that servers delay this client's
        # messages by its links (None: the map's default_region); checked before anything starts
        self.region = parse_region(region, None, "region")
        self.allowed_servers = frozenset(allowed_servers)
        self.block_wait = block_wait
        self.spot_checks = SpotChecker(self, spot_check_rate)
        self.audits = Auditor(self, audit_rate)
        self.loop = dht.EventLoop.get()
        # hidden states travel in this dtype (bfloat16 or float16 halve the bytes; float32 keeps outputs exact)
        self.wire_dtype = wire_dtype
        self.timeout = timeout  # for a whole-sequence forward, or opening a stream
        # a step may take this long, plus STEP_SECONDS_PER_TOKEN for each position it carries; a server that
        # stays silent longer (dead, stalled, cut off) is banned and its span re-routed
        self.step_timeout, self.max_retries = step_timeout, max_retries
        self.bans, self.load, self.dead = Bans(), PeerLoad(), DeadPeers()
        self.node = self.loop.run(dht.start_node(initial_peers, client_mode=True))
        # round trips, for routing; a peer that fails a step is probed at once, and left out if dead
        self.probes = RoundTripProbes(self.node.p2p, self.loop, self.load, self.bans, dead=self.dead)
        self.bans.on_ban = self.probes.confirm
        self._told_incompatible: set[tuple[str, str]] = set()  # (peer, version) logged as not spoken
        self._starts: dict[str, float] = {}  # peer -> when its newest record says it started
        # the steps of all this client's sessions on one server travel together (swarm/client/stubs.py)
        self.step_channels = StepChannels(self.node.p2p, timeout)
        self._region_announced = -REGION_TTL
        self._announce_region()

    def servers(self, prefix: str, num_blocks: int, adapter: Optional[str] = None,
                max_age: Optional[float] = 0.0, until: Optional[int] = None) -> list[RemoteServer]:
        """The online servers of a model that this client may route to (probed from now on: see probes.py); with
        `adapter`, only those that announce it. Looked up now by default (refreshing the client's shared view:
        swarm_view.py), else from the view at most `max_age` seconds old (None: an opening's; see chain). With
        `until`, only those that may hold the blocks before it, looked up now past the view (of whole lookups)."""
        self._announce_region()
        partial = until is not None and until < num_blocks
        found = self.loop.run(dht.fetch_servers(self.node, prefix, num_blocks, self.allowed_servers, until)) \
            if partial else self.view.servers(prefix, num_blocks, max_age, self.allowed_servers)
        servers = self._speaking(found)
        self.dead.seen(servers)
        self._note_restarts(servers)
        self.probes.consider(server.peer_id for server in servers)
        return [server for server in servers if adapter is None or adapter in server.info.adapters]

    @property
    def view(self) -> SwarmView:
        """One view of each model's servers, shared by every session, refreshed in the background (swarm_view.py);
        made on first use."""
        view = self.__dict__.get("_view")
        if view is None:
            view = self._view = SwarmView(self.loop, self._look_up_servers)
        return view

    async def _look_up_servers(self, prefix: str, num_blocks: int, allowed: frozenset) -> list[RemoteServer]:
        return await dht.fetch_servers(self.node, prefix, num_blocks, allowed)

    def adapters(self, prefix: str, num_blocks: int) -> set[str]:
        """The LoRA adapters of a model that online servers announce (at most MAX_ADAPTERS_PER_MODEL: see
        adapter_coverage)."""
        return set(self.adapter_coverage(prefix, num_blocks))

    def adapter_coverage(self, prefix: str, num_blocks: int) -> dict[str, Coverage]:
        """The LoRA adapters of a model that online servers announce, each with its coverage, from one lookup of
        the model's servers: at most MAX_ADAPTERS_PER_MODEL of them, as routing.announced_adapters ranks them
        (any peer may announce hundreds of names: a model's list, and what each name costs, stay bounded)."""
        servers = self.servers(prefix, num_blocks)
        coverage = {}
        for adapter in announced_adapters(servers, MAX_ADAPTERS_PER_MODEL):
            holders = [server for server in servers if adapter in server.info.adapters]
            coverage[adapter] = Coverage(num_blocks, len(holders), missing_ranges(holders, num_blocks))
        return coverage

    def _speaking(self, servers: list[RemoteServer]) -> list[RemoteServer]:
        """The servers whose protocol this client speaks (routing.speaks); each one left out is logged once per
        version it announces, as an operator upgrading a swarm server by server wants to see which lag."""
        for server in servers:
            told = (server.peer_id, server.info.version)
            if not speaks(server.info.version) and told not in self._told_incompatible:
                if len(self._told_incompatible) < 4096:  # any peer may announce versions: the log stays bounded
                    self._told_incompatible.add(told)
                    logger.warning("server %s speaks protocol %r, this client %s: not routed to", server.peer_id,
                                   server.info.version[:32], PROTOCOL_VERSION)
        return [server for server in servers if speaks(server.info.version)]

    def _announce_region(self) -> None:
        """Announce the client's region where it has one, again when half its record's life has passed."""
        if self.region is not None and time.monotonic() - self._region_announced > REGION_TTL / 2:
            self.loop.run(dht.announce_region(self.node, self.region, REGION_TTL))
            self._region_announced = time.monotonic()

    def _note_restarts(self, servers: list[RemoteServer]) -> None:
        """A server whose record shows a newer start than before says it restarted (same identity, maybe another
        address). Any peer may say so as often as it likes: a banned one earns one probe for it, which lifts its
        ban if answered (Bans.may_retry); its strikes, and what was measured of it, stay."""
        for server in servers:
            started, previous = server.info.started, self._starts.get(server.peer_id)
            if started is None:
                continue
            self._starts[server.peer_id] = started
            if previous is not None and started > previous and self.bans.may_retry(server.peer_id):
                logger.info("server %s restarted: probing it once, routing may use it again", server.peer_id)
                self.probes.retry(server.peer_id)

    def chain(
        self, prefix: str, num_blocks: int, model_name: str, exclude: Collection[str] = (), end: Optional[int] = None,
        start: int = 0, min_cache_tokens: int = 0, adapter: Optional[str] = None, replan=False, opening=False,
    ) -> list[ChainLink]:
        """The best chain over blocks [start, end) (default: all of them), around banned and excluded peers, of
        servers that hold the LoRA `adapter` (if any); each choice is logged (one line: which server runs which
        blocks), as Petals logs its routes. The servers are looked up now, but for sessions (remote_session.py):
        `opening` a session routes by the shared view of the swarm, and `replan` (a failed server's blocks
        re-routed) by the view as long as its records live (no lookup). Where the view has no server for some
        blocks but banned ones, they are looked up anew (a re-plan, only the keys that may hold them): a
        replacement may have joined since, before routing settles for a banned one or fails (MissingBlocksError)."""
        routing = (num_blocks, model_name, exclude, end, start, min_cache_tokens)
        servers = self.servers(prefix, num_blocks, adapter,
                               REPLAN_MAX_AGE if replan else None if opening else 0.0)
        try:
            chain = self._best_chain(servers, *routing, fall_back=False)
        except MissingBlocksError:
            until = (num_blocks if end is None else end) if replan else None
            chain = self._best_chain(self.servers(prefix, num_blocks, adapter, until=until), *routing, fall_back=True)
        if chain:
            logger.info("routed blocks %d:%d of %s through %s", chain[0].start, chain[-1].end, model_name,
                        " ".join(f"{link.peer_id}[{link.start}:{link.end}]" for link in chain))
        return chain

    def _best_chain(self, servers: list[RemoteServer], num_blocks: int, model_name: str, exclude: Collection[str],
                    end: Optional[int], start: int, min_cache_tokens: int, fall_back: bool = True) -> list[ChainLink]:
        """`fall_back`: on servers banned for failures, where only they hold some of the blocks."""
        end = num_blocks if end is None else end
        banned = self.bans.current()
        self.probes.measure_new([server.peer_id for server in servers if server.peer_id not in banned])
        exclude = {*exclude, *self.dead.current()}  # a dead server is no fallback: no session it gets can run
        try:
            return choose_chain(servers, end, model_name, {*exclude, *self.bans.current()}, start,
                                self.load.factors(), min_cache_tokens, self.load.measured(), self.round_trips(),
                                flowing_by_default() is not False)
        except MissingBlocksError:
            if not fall_back or not self.bans.current() - self.bans.distrusted():
                raise
            # only banned servers hold some of the blocks: a ban for a failure steers toward others, it must
            # not strand a session when there are none (a server that was only slow under a burst of load)
            return choose_chain(servers, end, model_name, {*exclude, *self.bans.distrusted()}, start,
                                self.load.factors(), min_cache_tokens, self.load.measured(), self.round_trips(),
                                flowing_by_default() is not False)

    def round_trips(self) -> dict[str, float]:
        """Seconds there and back to each server measured (the least of the last few probes): what routing weighs
        hops by."""
        return self.load.round_trips()

    def wait_for_chain(self, prefix: str, num_blocks: int, model_name: str,
                       on_wait: Optional[Callable[[str], None]] = None, **routing) -> list[ChainLink]:
        """`chain(...)`, but while no server holds some of the blocks, wait for one, up to block_wait seconds,
        then raise the MissingBlocksError. A wait is told once: a log line, the metrics (swarm/client/metrics.py)
        and `on_wait(message)`, e.g. "no server holds blocks 2..3 of tiny; waiting up to 30 s"."""
        with _BlockWait(self.block_wait, model_name, on_wait) as wait:
            while True:
                try:
                    return self.chain(prefix, num_blocks, model_name, **routing)
                except MissingBlocksError as missing:
                    wait.still_missing(missing)

    def longest_session(self, prefix: str, num_blocks: int) -> Optional[int]:
        """The most tokens (max_length x batch size) one session of the model can hold on the swarm now: for
        each block, the best max_session_tokens among the servers holding it; the least of those over the blocks.
        None if unknown (a block with no server, or only servers too old to announce it)."""
        return longest_session(self.servers(prefix, num_blocks), num_blocks)

    def catalogue(self) -> list[ModelRecord]:
        """The models the swarm's servers announce (one record per model, as most of its servers sign it)."""
        return self.loop.run(dht.fetch_catalogue(self.node, self.allowed_servers), timeout=10)

    def coverage(self, prefix: str, num_blocks: int, adapter: Optional[str] = None) -> Coverage:
        """How many online servers hold blocks of the model (with the LoRA `adapter`, if any), and which none holds."""
        servers = self.servers(prefix, num_blocks, adapter)
        return Coverage(num_blocks, len(servers), missing_ranges(servers, num_blocks))

    def health(self, prefix: str, num_blocks: int) -> SwarmHealth:
        servers = self.loop.run(dht.fetch_all_servers(self.node, prefix, num_blocks, self.allowed_servers))
        servers.sort(key=lambda server: (server.info.start, server.info.end, server.peer_id))
        online = [server for server in servers if server.info.state == ServerState.ONLINE]
        online = [server for server in online if speaks(server.info.version)]  # what routing may use
        reachable = {server.peer_id for server in online} - self.bans.current()
        self.probes.consider(reachable)  # a health page shows their round trips
        self.probes.measure_new(reachable)
        round_trips = {peer: seconds for peer, seconds in self.round_trips().items() if peer in reachable}
        return SwarmHealth(num_blocks, servers, servers_per_block(online, num_blocks),
                           missing_ranges(online, num_blocks), round_trips, self.bans.distrusted())

    def server_info(self, peer_id: str) -> dict:
        return self.loop.run(call_info(self.node.p2p, peer_id))

    def forward_blocks(self, prefix: str, num_blocks: int, model_name: str, hidden: torch.Tensor,
                       end: Optional[int] = None, adapter: Optional[str] = None) -> torch.Tensor:
        """A whole sequence through blocks [0, end) (through a LoRA `adapter`, if any) with no cache left behind,
        routed around servers that fail, err or have no room for it: each failure re-routes the blocks not yet
        run (max_retries times at most)."""
        start, end, avoided, failures = 0, num_blocks if end is None else end, set(), 0
        while start < end:
            chain = self.wait_for_chain(prefix, num_blocks, model_name, exclude=avoided, start=start, end=end,
                                        adapter=adapter)
            for link in chain:
                try:
                    hidden = self.forward([link], hidden, adapter)
                except (ServerUnavailableError, CacheFullError, InternalServerError) as error:
                    failures += 1
                    if failures > self.max_retries:
                        raise
                    logger.warning("forward through %s failed (%s); re-routing blocks %d:%d", link.peer_id, error,
                                   start, end)
                    avoided.add(link.peer_id)
                    if not isinstance(error, CacheFullError):  # no room for a long sequence is no fault
                        self.bans.ban(link.peer_id)
                    break
                start = link.end
        return hidden

    def forward(self, chain: list[ChainLink], hidden: torch.Tensor, adapter: Optional[str] = None) -> torch.Tensor:
        """A whole sequence through the chain, with no cache left behind: (batch, length, hidden) in and out;
        a sequence too large for one message streams (swarm/client/forwards.py)."""

        async def run_chain():
            output = hidden.to(self.wire_dtype)
            for link in chain:
                output = await forward_on(self.node.p2p, link.peer_id, output, link.start, link.end, self.timeout,
                                          adapter)
            return output

        return self.loop.run(run_chain()).to(hidden.dtype)

    def open_session(
        self, prefix: str, num_blocks: int, model_name: str, max_length: int, batch_size: int = 1,
        on_wait: Optional[Callable[[str], None]] = None, adapter: Optional[str] = None,
    ) -> RemoteSession:
        """A session over every block (through a LoRA `adapter`, if any); `on_wait(message)` is told when it
        waits for a server of some blocks."""
        route = Route(prefix, num_blocks, model_name, adapter)
        return RemoteSession(self._services(), route, max_length, batch_size, on_wait)

    def session_step_timeout(self) -> float:
        """A new session's step timeout: step_timeout, plus two of the longest round trips measured (at most
        MAX_ROUND_TRIP_ALLOWANCE): a far server (a real WAN, or --simulated-latency) is not taken for a dead one,
        and a dead one is still noticed within seconds."""
        longest = max(self.round_trips().values(), default=0.0)
        return self.step_timeout + min(2 * longest, MAX_ROUND_TRIP_ALLOWANCE)

    def _services(self) -> ClientServices:
        """What a session uses of this client: its settings as they are now, its shared state, its routing."""
        return ClientServices(
            loop=self.loop, p2p=self.node.p2p, step_channels=self.step_channels, bans=self.bans, load=self.load,
            spot_checks=self.spot_checks, audits=self.audits, find_chain=self.chain, wait_for_chain=self.wait_for_chain,
            wire_dtype=self.wire_dtype, open_timeout=self.timeout, step_timeout=self.session_step_timeout(),
            max_retries=self.max_retries, block_wait=self.block_wait)

    def shutdown(self) -> None:
        self.view.close()
        self.audits.close()
        self.probes.close()
        self.loop.run(self.step_channels.close())
        self.loop.run(self.node.shutdown())


class _BlockWait:
    """One session's (or request's) wait for a server to hold its missing blocks: told once, counted, bounded."""

    def __init__(self, seconds: float, model_name: str, on_wait: Optional[Callable[[str], None]]):
        self.seconds, self.model_name, self.on_wait = seconds, model_name, on_wait
        self.began: Optional[float] = None

    def still_missing(self, missing: MissingBlocksError) -> None:
        """Routing found blocks missing again: begin the wait, or sleep a while, or re-raise once it is over."""
        now = time.monotonic()
        if self.began is None:
            if self.seconds <= 0:
                raise missing
            self.began = now
            metrics.WAITING_FOR_BLOCKS.inc()
            message = f"{missing}; waiting up to {self.seconds:g} s"
            logger.warning(message)
            if self.on_wait is not None:  # if it fails (a WebSocket gone), nobody waits anymore: it ends the wait
                self.on_wait(message)
        remaining = self.began + self.seconds - now
        if remaining <= 0:
            raise missing
        time.sleep(min(BLOCK_POLL_SECONDS, remaining))

    def __enter__(self) -> "_BlockWait":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if self.began is None:
            return
        metrics.WAITING_FOR_BLOCKS.dec()
        seconds = time.monotonic() - self.began
        if error is None:
            metrics.BLOCK_WAITS.labels("served").inc()
            logger.info("blocks of %s are served again after %.1f s; going on", self.model_name, seconds)
        else:  # the wait is over, or whoever waited is gone (on_wait failed)
            metrics.BLOCK_WAITS.labels("gave_up" if isinstance(error, MissingBlocksError) else "abandoned").inc()
            logger.warning("stopped waiting for blocks of %s after %.1f s: %s", self.model_name, seconds, error)
