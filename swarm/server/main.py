"""A block server's process: join the swarm, take a span, load it, announce it, serve until stopped.

    python -m swarm.server --model NAME_OR_PATH --blocks START:END --initial-peers MADDR [...]

Compute runs on one dedicated thread (torch releases the GIL, so the event loop keeps answering the
network meanwhile); everything else happens on the asyncio loop of the main thread. With --metrics-port,
prometheus_client serves the server's metrics (swarm/server/metrics.py) from a thread of its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from swarm import dht, gc_tuning
from swarm.protocol import (
    MAX_CACHE_TOKENS,
    MAX_THROUGHPUT,
    BadRequestError,
    ModelRecord,
    ServerInfo,
    ServerState,
    dht_prefix,
)
from swarm.relays import RelayWait
from swarm.server import metrics, placement
from swarm.server.adapters import AdapterFolder, attach_adapters, read_adapter
from swarm.server.backend import Backend
from swarm.server.cache import CacheBudget
from swarm.server.settings import ServerSettings, parse_settings
from swarm.server.sizing import MemoryFit, fit_blocks, memory_budget
from swarm.server.span import BlockSpan, GraphsCaptured, load_span
from swarm.server.throughput import cached_throughput

if TYPE_CHECKING:
    from swarm.server.pushes import Pusher

logger = logging.getLogger(__name__)
# in every record: a client that banned this peer id sees a newer start as the server restarted, and uses it again
STARTED = time.time()


async def serve(settings: ServerSettings) -> None:
    from swarm.weights import load_config, resolve_model

    folder = resolve_model(settings.model, settings.cache_dir, settings.revision)
    config = load_config(folder)
    num_blocks = config.num_hidden_layers
    if settings.blocks is not None and settings.blocks[1] > num_blocks:
        start, end = settings.blocks
        raise BadRequestError(f"--blocks {start}:{end} is out of range: {settings.model} has blocks 0:{num_blocks}")
    adapters = [read_adapter(adapter) for adapter in settings.adapters]  # a wrong folder fails before anything loads
    fit = _fit_memory(settings, config)  # before the swarm hears of it: not even one block may fit
    if settings.device.type == "cuda":
        choose_attention_kernels()
    # first, so that a port already taken fails in a second rather than after the weights load
    metrics_server, metrics_address = _start_metrics(settings)
    node = await dht.start_node(settings.initial_peers, settings.host, settings.port, settings.identity,
                                relays=settings.relay_through, serve_relay=settings.serve_as_relay,
                                announce_maddrs=settings.announce_maddrs)
    try:
        length = fit.holds if fit is not None else settings.num_blocks
        presence = await Presence.join(node, settings, folder, num_blocks, adapters, length)
        gc_tuning.serving_process()  # the weights, the graphs and the imports: never collected again
        print(f"ready: blocks {presence.start}:{presence.end} of {presence.prefix} as peer {dht.peer_id_of(node)}, "
              f"{_weights_description(presence.span)} on {presence.span.device}, {presence.throughput:.1f} tokens/s, "
              f"cache {settings.cache_tokens} tokens"
              + (f", {fit.describe()}" if fit is not None else "")
              + await _announced_description(node, settings)
              + _graphs_description(presence.graphs_captured)
              + _memory_description(presence.span, presence.graphs_captured)
              + (f", adapters {' '.join(sorted(presence.span.adapters))}" if adapters else "")
              + (f", {settings.latency.describe()}" if settings.latency.enabled else "")
              + (f", metrics at {metrics_address}" if metrics_address else ""),
              flush=True)
        await presence.serve_until_stopped()
        await presence.withdraw()
    finally:
        await node.shutdown()
        if metrics_server is not None:
            metrics_server.shutdown()


class Presence:
    """The server as the swarm sees it: its span, announced every period, and moved when the swarm is uneven."""

    def __init__(self, node, settings: ServerSettings, folder: Path, num_blocks: int, span: BlockSpan,
                 throughput: float, adapters: list[AdapterFolder]):
        self.node, self.settings, self.folder, self.num_blocks = node, settings, folder, num_blocks
        self.adapters = adapters  # read once: a moved span gets them too
        self.prefix = settings.dht_prefix or dht_prefix(settings.model)
        self.span, self.throughput = span, throughput
        self.backend = Backend(span, CacheBudget(settings.cache_tokens), settings.limits,
                               max_batch_tokens=settings.max_batch_tokens,
                               prefill_chunk_tokens=settings.prefill_chunk_tokens)
        self.expiration = 3 * settings.announce_period
        self.relayed = bool(settings.relay_through)  # reached through relays: its record says so
        self.graphs_captured: Optional[GraphsCaptured] = None  # the rounds captured ahead at start-up, if any
        self.pusher: Optional[Pusher] = None  # its pushes' round trips (and pings') to the next servers: announced
        self._pings: Optional[asyncio.Task] = None  # the pings of the next servers, started at an announcement

    @property
    def start(self) -> int:
        return self.span.start

    @property
    def end(self) -> int:
        return self.span.end

    @classmethod
    async def join(cls, node, settings: ServerSettings, folder: Path, num_blocks: int,
                   adapters: list[AdapterFolder], length: Optional[int] = None) -> "Presence":
        """Claim a span (settings.blocks, else the least served one of `length` blocks), load it (announced as
        joining meanwhile), take requests, and announce it online."""
        from swarm.server.pushes import PushTargets
        from swarm.server.handler import BlockHandler

        prefix = settings.dht_prefix or dht_prefix(settings.model)
        if settings.blocks is not None:
            start, end = settings.blocks
        else:
            start, end = await placement.claim_span(node, prefix, num_blocks, length, settings.announce_period)
        # a big span takes minutes to load: the swarm's health page shows the server as joining meanwhile
        relay_wait = RelayWait.starting_now(settings.relay_through)
        joining = ServerInfo(ServerState.JOINING, start, end, 0.0, settings.cache_tokens, started=STARTED,
                             relayed=bool(settings.relay_through))
        loaded = _load(settings, folder, start, end, adapters)
        span, throughput = await _announced_while(node, prefix, joining, settings.announce_period, loaded)
        presence = cls(node, settings, folder, num_blocks, span, throughput, adapters)
        # on its pool, before any request can come: no capture lands on a request's path
        presence.graphs_captured = await asyncio.to_thread(span.capture_graphs_ahead, settings.max_batch_tokens,
                                                           settings.limits.max_session_tokens)
        metrics.watch_cache(presence.backend.budget)
        push_targets = PushTargets(node, prefix, settings.allowed_servers)
        settings.latency.bind(node)
        await settings.latency.announce(node, presence.expiration)  # before any request: its callers see it
        handler = BlockHandler(presence.backend, settings.allowed_peers, push_targets, settings.latency)
        presence.pusher = handler.pusher
        await handler.add_p2p_handlers(node.p2p)
        await relay_wait.until_reserved()  # online only once clients can reach it
        await presence.announce_online()
        return presence

    def record(self, state: ServerState) -> ServerInfo:
        # within the bounds clients accept (swarm/protocol.py), or they would ignore the record
        throughput = min(self.throughput, MAX_THROUGHPUT)
        max_session_tokens = min(self.backend.limits.max_session_tokens, self.backend.budget.total)
        available = min(self.backend.cache_tokens_available, MAX_CACHE_TOKENS)  # parked sessions make way
        return ServerInfo(state, self.start, self.end, throughput, available,
                          max_session_tokens=min(max_session_tokens, MAX_CACHE_TOKENS), started=STARTED,
                          adapters=tuple(sorted(self.span.adapters)), relayed=self.relayed,
                          round_trips=self.pusher.round_trips.announced() if self.pusher else ())

    async def announce_online(self) -> None:
        from swarm.weights import catalogue_name

        model = self.settings.model
        record = ModelRecord(catalogue_name(model, self.folder), self.prefix, self.num_blocks, model)
        await dht.announce(self.node, self.prefix, self.record(ServerState.ONLINE), expiration=self.expiration)
        await dht.announce_model(self.node, record, expiration=self.expiration)
        await self.settings.latency.announce(self.node, self.expiration)

    def _ping_next_servers(self) -> None:
        """Measure the round trips to the servers of the block after this span, in the background: announced
        from the next announcement on (an unanswering peer never holds one up). Not at the first announcement:
        the next servers learn this one's region (a network map's) meanwhile."""
        if self.pusher is None or self.end >= self.num_blocks or (self._pings and not self._pings.done()):
            return
        self._pings = asyncio.ensure_future(self.pusher.ping_next(self.end, dht.peer_id_of(self.node)))

    async def serve_until_stopped(self) -> None:
        """Announce every period, and consider moving every rebalance period, until SIGINT or SIGTERM."""
        stop = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        period = self.settings.rebalance_period
        next_check, advice = time.monotonic() + period, None
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.settings.announce_period)
                continue
            except asyncio.TimeoutError:
                await self.announce_online()
                self._ping_next_servers()
            if not period or time.monotonic() < next_check:
                continue
            next_check = time.monotonic() + period
            target = await placement.advised_move(self.node, self.prefix, self.num_blocks,
                                                  self.record(ServerState.ONLINE))
            if target is not None and target == advice:  # move only on the same advice twice in a row
                await self.move_to(*target)
                target = None
            advice = target

    async def move_to(self, start: int, end: int) -> None:
        """Serve blocks [start, end) instead. The new span and its pool are made while the old ones still
        serve: where that fails (out of memory, a CUDA error), the old span serves on, as if never advised."""
        old = self.record(ServerState.OFFLINE)
        logger.info("moving from blocks %d:%d to %d:%d to even out the swarm", self.start, self.end, start, end)
        try:
            span, throughput = await _load(self.settings, self.folder, start, end, self.adapters, reuse=self.span)
            self.backend.move_to(span)
        except Exception:
            logger.warning("could not move to blocks %d:%d; serving blocks %d:%d on", start, end, self.start,
                           self.end, exc_info=True)
            span = None  # nothing holds what the new span took any more
        if span is None:
            if self.span.device.type == "cuda":
                torch.cuda.empty_cache()
            return
        self.span, self.throughput = span, throughput
        await dht.announce(self.node, self.prefix, old, expiration=self.expiration)  # leave the old span's key
        await dht.announce(self.node, self.prefix, self.record(ServerState.ONLINE), expiration=self.expiration)
        print(f"moved: blocks {start}:{end} of {self.prefix}", flush=True)

    async def withdraw(self) -> None:
        """Announce OFFLINE at once: clients stop routing new sessions here. The DHT keeps whichever record
        expires last, so the OFFLINE one must outlive the ONLINE one it replaces."""
        withdrawal = dht.announce(self.node, self.prefix, self.record(ServerState.OFFLINE), self.expiration)
        try:
            await asyncio.wait_for(withdrawal, timeout=5)
            logger.info("withdrew from the swarm; shutting down")
        except asyncio.TimeoutError:
            logger.warning("could not withdraw in time; the records will expire by themselves")


async def _load(settings: ServerSettings, folder: Path, start: int, end: int, adapters: list[AdapterFolder],
                reuse: Optional[BlockSpan] = None) -> tuple[BlockSpan, float]:
    """The span (with its adapters) and its throughput, off the event loop, so that the DHT node keeps answering
    its peers."""
    span = await asyncio.to_thread(load_span, folder, start, end, device=settings.device, dtype=settings.dtype,
                                   reuse=reuse, quantization=settings.quantization)
    attach_adapters(span, adapters)
    if settings.cuda_graphs and span.device.type == "cuda" and not span.quantization:
        span.use_graphs()  # bitsandbytes' kernels sync with the host: quantized spans stay eager
    return span, await asyncio.to_thread(cached_throughput, span, folder, settings.cache_dir)


def _fit_memory(settings: ServerSettings, config) -> Optional[MemoryFit]:
    """How many blocks the device's memory fits, where neither --blocks nor --num-blocks says how many to hold."""
    if settings.blocks is not None or settings.num_blocks is not None:
        return None
    budget, source = memory_budget(settings.device, settings.memory_budget)
    graphs = settings.cuda_graphs and settings.device.type == "cuda" and not settings.quantization
    return fit_blocks(config, settings.dtype, settings.quantization, settings.cache_tokens, settings.max_batch_tokens,
                      budget, source, graphs)


async def _announced_description(node, settings: ServerSettings) -> str:
    """The addresses the server's libp2p host gives out, where the operator chose them (--public-address)."""
    if not settings.announce_maddrs:
        return ""
    return f", announced at {' '.join(str(address) for address in await node.get_visible_maddrs(latest=True))}"


def choose_attention_kernels() -> None:
    """Attention kernels for the shapes a server runs: torch prefers cuDNN's on an H100, which builds a plan
    for every new shape, and eager rounds (prefill chunks, rounds past the graphs) change shape nearly every
    time; flash and memory-efficient attention take any shape as it comes."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def _graphs_description(captured: Optional[GraphsCaptured]) -> str:
    if captured is None:
        return ""
    return (f", {captured.rounds} CUDA graphs of its rounds captured in {captured.seconds:.1f} s, holding "
            f"{captured.memory_bytes / 2**20:.0f} MiB")


def device_memory(span: BlockSpan, captured: Optional[GraphsCaptured]) -> dict[str, int]:
    """What a server on a GPU holds there, in bytes: its weights, its cache pool, its graphs, and what torch's
    allocator does not see (the CUDA context, libraries' workspaces): this process's memory on the device past
    what torch reserved, as NVML counts it (pynvml), else the device's used memory past it (an upper bound where
    other processes share the device). What it needs in all is their sum."""
    pool = span.pool.keys.numel() * span.pool.keys.element_size() * 2 if span.pool is not None else 0
    held = {"weights": span.weight_bytes(), "cache": pool, "graphs": captured.memory_bytes if captured else 0}
    used = _process_device_bytes(span.device)
    if used is None:
        free, total = torch.cuda.mem_get_info(span.device)
        used = total - free
    held["context"] = max(used - torch.cuda.memory_reserved(span.device), 0)
    return held


def _process_device_bytes(device: torch.device) -> Optional[int]:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        mine = [process.usedGpuMemory for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                if process.pid == os.getpid()]
        return mine[0] if mine and mine[0] else None
    except Exception:  # no pynvml, or NVML cannot see this process's (a container's own pid namespace)
        return None


def _memory_description(span: BlockSpan, captured: Optional[GraphsCaptured]) -> str:
    if span.device.type != "cuda":
        return ""
    held = device_memory(span, captured)
    parts = ", ".join(f"{name} {size / 2**30:.2f}" for name, size in held.items())
    return f", GPU memory {sum(held.values()) / 2**30:.2f} GiB ({parts})"


def _weights_description(span: BlockSpan) -> str:
    dtype = str(span.dtype).removeprefix("torch.")
    size = f"{span.weight_bytes() / 2**20:.0f} MiB of weights"
    return f"{dtype} ({span.quantization} weights, {size})" if span.quantization else f"{dtype} ({size})"


def _start_metrics(settings: ServerSettings):
    """prometheus_client's HTTP server for --metrics-port (none for 0), and the address it serves."""
    if not settings.metrics_port:
        return None, None
    try:
        return metrics.start_server_metrics(settings.host, settings.metrics_port)
    except OSError as error:
        raise BadRequestError(f"--metrics-port {settings.metrics_port}: cannot listen on {settings.host}: "
                              f"{error.strerror}") from None


async def _announced_while(node, prefix: str, info: ServerInfo, period: float, work):
    """Await `work`, keeping `info` announced until it is done; returns what `work` returns."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            await dht.announce(node, prefix, info, expiration=3 * period)
            done, _ = await asyncio.wait({task}, timeout=period)
            if done:
                return task.result()
    finally:
        task.cancel()  # a no-op once done; otherwise an announce failed and the work is not wanted anymore


def main(argv: Optional[list[str]] = None) -> None:
    launch(parse_settings(argv))


def launch(settings: ServerSettings) -> None:
    """Serve until stopped, a failure the operator can act on told in one line."""
    from swarm.cli import run_main, setup_logging

    setup_logging()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    run_main(lambda: asyncio.run(serve(settings)))


if __name__ == "__main__":
    main()
