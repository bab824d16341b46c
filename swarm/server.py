"""A block server: holds a span of a model's blocks, announces it in the DHT and serves inference sessions.

    python -m swarm.server --model NAME_OR_PATH --blocks START:END --initial-peers MADDR [...]

Compute runs on one dedicated thread (torch releases the GIL, so the event loop keeps answering the
network meanwhile); everything else happens on the asyncio loop of the main thread. With --metrics-port,
prometheus_client serves the server's metrics (swarm/metrics.py) from a thread of its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch

from swarm import metrics
from swarm.blocks import BlockSpan
from swarm.batching import Scheduler
from swarm.cache import PAGE_TOKENS, CacheBudget, pages_for
from swarm.protocol import (
    PROTOCOL_VERSION,
    BadRequestError,
    ServerInfo,
    ServerLimitError,
    ServerState,
    ServerUnavailableError,
    SessionLengthError,
)

logger = logging.getLogger(__name__)

MAX_BATCH_SIZE = 64
# what hidden states may travel as (config.WIRE_DTYPES); any other dtype is refused before it reaches a batch
HIDDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Limits:
    """What any one client may ask of the server: every request comes from a peer nobody vetted."""

    max_request_tokens: int = 8192  # rows x positions of one request: a step, a push, a cache-less forward
    max_session_tokens: int = 8192  # max_length x batch_size of one session: the most cache it may grow to
    max_sessions_per_peer: int = 256  # open at once from one peer (a gateway is one peer for all its users)
    cache_wait: float = 3.0  # seconds a step waits for cache when it is full, before it is refused


class Backend:
    """What the RPC handlers call: validates requests against the span and the limits, queues them for the
    compute thread (swarm/batching.py), and keeps the sessions' caches within the budget."""

    def __init__(self, span: BlockSpan, budget: CacheBudget, limits: Limits = Limits(), **batching):
        self.span, self.budget, self.limits = span, budget, limits
        self.hidden_size = span.config.hidden_size
        self.max_positions = getattr(span.config, "max_position_embeddings", None) or 1 << 20
        self.scheduler = Scheduler(lambda: self.span, **batching)
        self.positions_served = 0  # positions run through inference sessions: shows what clients re-send
        self.steps_pushed = 0  # steps started from the previous server's push, before the client's copy came
        self.sessions: set[ServerSession] = set()
        self.sessions_by_id: dict[str, ServerSession] = {}  # those a previous server may push steps to
        self.sessions_by_peer: Counter[str] = Counter()

    def move_to(self, span: BlockSpan) -> None:
        """Serve another span from now on; open sessions end (their clients fail over to other servers)."""
        for session in list(self.sessions):
            session.evicted = True
        self.span = span

    def info(self) -> dict:
        return {
            "start": self.span.start,
            "end": self.span.end,
            "dtype": str(self.span.dtype).removeprefix("torch."),
            "quantization": self.span.quantization,
            "device": str(self.span.device),
            "cache_tokens_free": self.budget.free,
            "positions_served": self.positions_served,
            "steps_pushed": self.steps_pushed,
            "version": PROTOCOL_VERSION,
            "loaded_names": self.span.loaded_names,
        }

    async def forward(self, tensors: list, metadata: dict) -> torch.Tensor:
        start, end = self._block_range(metadata)
        hidden = self.check_hidden_states(tensors)
        if hidden.shape[1] > self.max_positions:
            raise SessionLengthError(f"sequence of {hidden.shape[1]} tokens exceeds {self.max_positions} positions")
        return await self.scheduler.run(hidden, 0, start, end)

    async def open_session(self, metadata: dict, peer_id: str) -> "ServerSession":
        """A new session for peer `peer_id`, holding its first page of cache (refused with CacheFullError if
        none frees up, or ServerLimitError past the limits on one client)."""
        start, end = self._block_range(metadata)
        max_length = _int_field(metadata, "max_length", 1, self.max_positions)
        batch_size = _int_field(metadata, "batch_size", 1, MAX_BATCH_SIZE)
        session_id = metadata.get("session_id")
        if session_id is not None and not (isinstance(session_id, str) and 16 <= len(session_id) <= 64):
            raise BadRequestError("field 'session_id' must be a string of 16 to 64 characters (a random token)")
        if session_id in self.sessions_by_id:
            raise BadRequestError("field 'session_id' is already in use")
        if max_length * batch_size > self.limits.max_session_tokens:
            raise ServerLimitError(f"a session of max_length {max_length} x batch_size {batch_size} is over this "
                                   f"server's limit of {self.limits.max_session_tokens} tokens per session")
        if self.sessions_by_peer[peer_id] >= self.limits.max_sessions_per_peer:
            raise ServerLimitError(f"peer {peer_id} has {self.sessions_by_peer[peer_id]} sessions open on this "
                                   f"server already, its limit per peer")
        session = ServerSession(self, start, end, max_length, batch_size, peer_id, session_id)
        try:
            await session.reserve(1)
        except BaseException:
            session.close()
            raise
        return session

    def accept_push(self, tensors: list, metadata: dict) -> None:
        """A step's inputs pushed by the previous server of a client's chain (see ServerSession.pushed)."""
        session_id = metadata.get("session_id")
        session = self.sessions_by_id.get(session_id) if isinstance(session_id, str) else None
        if session is None:
            raise BadRequestError("no open session has this 'session_id'")
        session.pushed(tensors, metadata)

    def close(self) -> None:
        self.scheduler.stop()

    def _block_range(self, metadata: dict) -> tuple[int, int]:
        start = _int_field(metadata, "start", self.span.start, self.span.end - 1)
        end = _int_field(metadata, "end", start + 1, self.span.end)
        return start, end

    def check_hidden_states(self, tensors: list, batch_size: int | None = None) -> torch.Tensor:
        """The one tensor of hidden states a request carries, refused unless a span can run it as it is."""
        if len(tensors) != 1:
            raise BadRequestError(f"expected one tensor of hidden states, got {len(tensors)}")
        hidden = tensors[0]
        if hidden.ndim != 3 or hidden.shape[2] != self.hidden_size or hidden.shape[1] < 1 or hidden.shape[0] < 1:
            raise BadRequestError(
                f"hidden states must have shape (batch, length >= 1, {self.hidden_size}), got {tuple(hidden.shape)}"
            )
        if batch_size is not None and hidden.shape[0] != batch_size:
            raise BadRequestError(f"this session has batch size {batch_size}, got {hidden.shape[0]}")
        if hidden.dtype not in HIDDEN_DTYPES:
            names = ", ".join(str(dtype).removeprefix("torch.") for dtype in HIDDEN_DTYPES)
            raise BadRequestError(f"hidden states must be floating point ({names}), got {hidden.dtype}")
        tokens = hidden.shape[0] * hidden.shape[1]
        if tokens > self.limits.max_request_tokens:
            raise BadRequestError(f"a request of {hidden.shape[0]} x {hidden.shape[1]} tokens is over this server's "
                                  f"limit of {self.limits.max_request_tokens} tokens per request")
        if not torch.isfinite(hidden).all():  # it would poison the session's cache, and anything computed after
            raise BadRequestError("hidden states must be finite (no NaN or infinity)")
        return hidden.detach()  # a request may say requires_grad: nothing here needs a graph


@dataclass
class EarlyStep:
    """A step started from the previous server's push, before the client's own copy of its inputs came."""

    step_id: int
    tensors: list  # what the push carried
    position: int
    result: asyncio.Future

    def ran(self, tensors: list, metadata: dict) -> bool:
        """Whether it ran these inputs, successfully: then its result is the client's step's result."""
        if not self.result.done() or self.result.cancelled() or self.result.exception() is not None:
            return False
        position = metadata.get("position")
        if len(tensors) != 1 or len(self.tensors) != 1 or not _is_int(position) or position != self.position:
            return False
        pushed, sent = self.tensors[0], tensors[0]
        return pushed.dtype == sent.dtype and pushed.shape == sent.shape and torch.equal(pushed, sent)


class ServerSession:
    """One client's inference session on this server: its attention cache and how far it is filled.

    A step's inputs come from the client, and may come earlier from the previous server of the client's
    chain, which pushes its outputs here as soon as it has them (server-to-server push): the step then starts
    at once, and the client's own copy of the inputs, arriving later, collects the result. Step ids
    (increasing per session) tell which copy came first. The client's copy is what counts: a push only ever
    continues the session where it is (never rewinds it), and a pushed step whose inputs differ from the
    client's copy (a server that pushes other outputs than it returns to the client) runs again from the
    client's copy. Steps of a session never overlap, whoever sends them.
    """

    def __init__(self, backend: Backend, start: int, end: int, max_length: int, batch_size: int, peer_id: str,
                 session_id: Optional[str] = None):
        self.backend, self.start, self.end = backend, start, end
        self.max_length, self.batch_size, self.peer_id, self.id = max_length, batch_size, peer_id, session_id
        self.cache = backend.span.new_cache(start, end, batch_size)  # empty: it takes pages as it grows
        self.length = 0  # positions filled in the cache
        self._closed = False
        self.evicted = False  # the server moved to other blocks: the client must go elsewhere
        self._newest_step = -1  # the highest step id started
        self._early: Optional[EarlyStep] = None
        self._one_step_at_a_time = asyncio.Lock()
        backend.sessions.add(self)
        backend.sessions_by_peer[peer_id] += 1
        if session_id is not None:
            backend.sessions_by_id[session_id] = self
        metrics.SESSIONS.inc()

    async def step(self, tensors: list, metadata: dict) -> torch.Tensor:
        step_id = metadata.get("step_id")
        if step_id is not None and not _is_int(step_id):
            raise BadRequestError(f"field 'step_id' must be an integer, got {step_id!r}")
        early, self._early = self._early, None
        if early is not None:
            await asyncio.wait([early.result])  # its result, or a stale push finished: steps never overlap
            if early.step_id == step_id and early.ran(tensors, metadata):
                return early.result.result()
        if step_id is not None:
            self._newest_step = max(self._newest_step, step_id)
        return await self._run(tensors, metadata)

    def pushed(self, tensors: list, metadata: dict) -> None:
        step_id = metadata.get("step_id")
        if not _is_int(step_id):
            raise BadRequestError(f"field 'step_id' must be an integer, got {step_id!r}")
        if step_id <= self._newest_step or self._early is not None or metadata.get("position") != self.length:
            # the client's copy came first, or an earlier push awaits it, or the push would not continue the
            # session where it is (an honest one only rewinds it when the client does): the client's copy will do
            return
        self._newest_step = step_id
        self.backend.steps_pushed += 1
        started = asyncio.ensure_future(self._run(tensors, metadata))
        started.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved, not logged
        self._early = EarlyStep(step_id, tensors, self.length, started)

    async def _run(self, tensors: list, metadata: dict) -> torch.Tensor:
        async with self._one_step_at_a_time:
            if self.evicted:
                raise ServerUnavailableError(f"this server no longer holds blocks {self.start}:{self.end}")
            hidden = self.backend.check_hidden_states(tensors, self.batch_size)
            # a position below the current length rewinds the session (regenerate, or a replay after failover)
            position = _int_field(metadata, "position", 0, self.length)
            end = position + hidden.shape[1]
            if end > self.max_length:
                raise SessionLengthError(
                    f"session max_length exceeded: {end} tokens would not fit in max_length={self.max_length}"
                )
            await self.reserve(end)
            output = await self.backend.scheduler.run(hidden, position, self.start, self.end, self.cache,
                                                      self._wanted)
            self.length = end
            self.backend.positions_served += hidden.shape[1]
            metrics.POSITIONS_SERVED.inc(hidden.shape[1])
            return output

    async def reserve(self, positions: int) -> None:
        """Pages of the budget for `positions` positions of every row (waiting a bounded time for them)."""
        if positions <= self.cache.reserved:
            return
        wanted = min(pages_for(positions) * PAGE_TOKENS, max(self.max_length, positions))
        wait = self.backend.limits.cache_wait
        await self.backend.budget.take((wanted - self.cache.reserved) * self.batch_size, wait)
        if self._closed:  # closed while waiting: give the pages straight back
            self.backend.budget.give_back((wanted - self.cache.reserved) * self.batch_size)
            raise ServerUnavailableError("the session ended while waiting for cache")
        self.cache.reserved = wanted

    def _wanted(self) -> bool:
        return not (self._closed or self.evicted)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._early is not None:
                self._early.result.cancel()
            self.backend.budget.give_back(self.cache.tokens)
            self.backend.sessions.discard(self)
            self.backend.sessions_by_peer -= Counter([self.peer_id])  # a peer with none left leaves the counter
            self.backend.sessions_by_id.pop(self.id, None)
            metrics.SESSIONS.dec()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # msgpack's true is a Python int too


def _int_field(metadata: dict, name: str, low: int, high: int) -> int:
    value = metadata.get(name)
    if not _is_int(value) or not low <= value <= high:
        raise BadRequestError(f"field {name!r} must be an integer in [{low}, {high}], got {value!r}")
    return value


def cached_throughput(span: BlockSpan, folder, cache_dir) -> float:
    """measure_throughput, remembered on disk per model, span, device and dtype: a restart announces the
    figure at once (and a GPU box is not timed while it warms up)."""
    import json
    from pathlib import Path

    path = Path(cache_dir) / "throughput.json"
    key = (f"{Path(folder).resolve()}|{span.start}:{span.end}|{span.device}|{span.dtype}|{span.quantization}"
           f"|torch {torch.__version__}")
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known.get(key), (int, float)):
        known[key] = measure_throughput(span)
        known = dict(list(known.items())[-256:])  # the newest entries; old folders come and go
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".{os.getpid()}.tmp")  # servers starting together must not see half a file
        staging.write_text(json.dumps(known, indent=1))
        staging.replace(path)
    return float(known[key])


def measure_throughput(span: BlockSpan, repeats: int = 5) -> float:
    """Tokens per second of one decode step through the whole span (a median, after one warm-up)."""
    hidden = torch.zeros(1, 1, span.config.hidden_size, dtype=span.dtype, device=span.device)
    timings = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        span(hidden)
        if span.device.type == "cuda":
            torch.cuda.synchronize(span.device)
        timings.append(time.perf_counter() - began)
    return 1.0 / max(statistics.median(timings[1:]), 1e-9)


# ------------------------------------------------------------------------------------------- process


async def serve(args) -> None:
    from swarm import dht
    from swarm.blocks import load_span
    from swarm import placement
    from swarm.protocol import ModelRecord, dht_prefix
    from swarm.rpc import BlockService
    from swarm.weights import KNOWN_MODELS, load_config, resolve_model

    folder = resolve_model(args.model, args.cache_dir)
    num_blocks = load_config(folder).num_hidden_layers
    if args.blocks is not None and args.blocks[1] > num_blocks:
        raise BadRequestError(f"--blocks {args.blocks[0]}:{args.blocks[1]} is out of range: {args.model} has blocks 0:{num_blocks}")
    prefix = args.dht_prefix or dht_prefix(args.model)
    # first, so that a port already taken fails in a second rather than after the weights load
    metrics_server, metrics_address = _start_metrics(args)

    node = await dht.start_node(args.initial_peers, args.host, args.port, args.identity)
    try:
        if args.blocks is not None:
            start, end = args.blocks
        else:
            start, end = await placement.claim_span(node, prefix, num_blocks, args.num_blocks, args.announce_period)

        async def load():
            # off the event loop, so that the DHT node keeps answering its peers while weights load
            span = await asyncio.to_thread(load_span, folder, start, end, device=args.device, dtype=args.dtype,
                                           quantization=args.quantize)
            return span, await asyncio.to_thread(cached_throughput, span, folder, args.cache_dir)

        # a big span takes minutes to load: the swarm's health page shows the server as joining meanwhile
        joining = ServerInfo(ServerState.JOINING, start, end, 0.0, args.cache_tokens)
        span, throughput = await _announced_while(node, prefix, joining, args.announce_period, load())
        limits = Limits(args.max_request_tokens, args.max_session_tokens, args.max_sessions_per_peer, args.cache_wait)
        backend = Backend(span, CacheBudget(args.cache_tokens), limits, max_batch_tokens=args.max_batch_tokens,
                          prefill_chunk_tokens=args.prefill_chunk_tokens)
        metrics.watch_cache(backend.budget)
        # a private server takes requests from its clients, and pushes from the other servers of its swarm
        allowed = {*args.allowed_clients, *args.allowed_servers} if args.allowed_clients else ()
        await BlockService(backend, allowed).add_p2p_handlers(node.p2p)

        def record(state: ServerState) -> ServerInfo:
            return ServerInfo(state, start, end, throughput, backend.budget.free)

        model = ModelRecord(args.model if args.model in KNOWN_MODELS else folder.name, prefix, num_blocks, args.model)

        async def announce_online():
            await dht.announce(node, prefix, record(ServerState.ONLINE), expiration=3 * args.announce_period)
            await dht.announce_model(node, model, expiration=3 * args.announce_period)

        await announce_online()
        print(
            f"ready: blocks {start}:{end} of {prefix} as peer {dht.peer_id_of(node)}, "
            f"{_weights_description(span)} on {span.device}, {throughput:.1f} tokens/s, "
            f"cache {args.cache_tokens} tokens" + (f", metrics at {metrics_address}" if metrics_address else ""),
            flush=True,
        )
        stop = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        next_check, advice = time.monotonic() + args.rebalance_period, None
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), args.announce_period)
                continue
            except asyncio.TimeoutError:
                await announce_online()
            if not args.rebalance_period or time.monotonic() < next_check:
                continue
            next_check = time.monotonic() + args.rebalance_period
            target = await placement.advised_move(node, prefix, num_blocks, record(ServerState.ONLINE))
            if target is None or target != advice:  # move only on the same advice twice in a row
                advice = target
                continue
            old = record(ServerState.OFFLINE)
            logger.info("moving from blocks %d:%d to %d:%d to even out the swarm", start, end, *target)
            span = await asyncio.to_thread(load_span, folder, *target, device=args.device, dtype=args.dtype,
                                           reuse=backend.span, quantization=args.quantize)
            backend.move_to(span)
            start, end = target
            throughput = await asyncio.to_thread(cached_throughput, span, folder, args.cache_dir)
            await dht.announce(node, prefix, old, expiration=3 * args.announce_period)  # leave the old blocks
            await dht.announce(node, prefix, record(ServerState.ONLINE), expiration=3 * args.announce_period)
            print(f"moved: blocks {start}:{end} of {prefix}", flush=True)
            advice = None
        # withdraw at once: clients stop routing new sessions here. The DHT keeps whichever record expires
        # last, so the OFFLINE one must outlive the ONLINE one it replaces.
        withdrawal = dht.announce(node, prefix, record(ServerState.OFFLINE), expiration=3 * args.announce_period)
        try:
            await asyncio.wait_for(withdrawal, timeout=5)
            logger.info("withdrew from the swarm; shutting down")
        except asyncio.TimeoutError:
            logger.warning("could not withdraw in time; the records will expire by themselves")
    finally:
        await node.shutdown()
        if metrics_server is not None:
            metrics_server.shutdown()


def _weights_description(span: BlockSpan) -> str:
    dtype = str(span.dtype).removeprefix("torch.")
    size = f"{span.weight_bytes() / 2**20:.0f} MiB of weights"
    return f"{dtype} ({span.quantization} weights, {size})" if span.quantization else f"{dtype} ({size})"


def _start_metrics(args):
    """prometheus_client's HTTP server for --metrics-port (none for 0), and the address it serves."""
    if not args.metrics_port:
        return None, None
    try:
        return metrics.start_server_metrics(args.host, args.metrics_port)
    except OSError as error:
        raise BadRequestError(f"--metrics-port {args.metrics_port}: cannot listen on {args.host}: {error.strerror}") from None


async def _announced_while(node, prefix: str, info: ServerInfo, period: float, work):
    """Await `work`, keeping `info` announced until it is done; returns what `work` returns."""
    from swarm import dht

    task = asyncio.ensure_future(work)
    try:
        while True:
            await dht.announce(node, prefix, info, expiration=3 * period)
            done, _ = await asyncio.wait({task}, timeout=period)
            if done:
                return task.result()
    finally:
        task.cancel()  # a no-op once done; otherwise an announce failed and the work is not wanted anymore


def parse_args(argv=None):
    from swarm.blocks import QUANTIZATIONS
    from swarm.cli import ArgumentParser, multiaddr, parse_block_range, settings_from_env

    settings = settings_from_env()
    parser = ArgumentParser(prog="python -m swarm.server", description="Serve a span of a model's blocks.")
    parser.add_argument("--model", default=settings.model, help="a known model name or a Hugging Face folder")
    span = parser.add_mutually_exclusive_group(required=True)
    span.add_argument("--blocks", type=parse_block_range, help="START:END, the half-open range of blocks to hold")
    span.add_argument("--num-blocks", type=int, help="hold N blocks, choosing the span the swarm serves least")
    parser.add_argument("--initial-peers", nargs="*", type=multiaddr, default=list(settings.initial_peers))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--identity", help="a key file, created if missing, that keeps the peer id stable")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--quantize", choices=QUANTIZATIONS,
                        help="store the blocks' linear weights in 8 bits (int8) or 4 bits (nf4) with bitsandbytes")
    parser.add_argument("--cache-tokens", type=int, default=settings.cache_tokens,
                        help="attention cache budget, in token slots (sessions take them a page at a time)")
    parser.add_argument("--cache-wait", type=float, default=Limits.cache_wait,
                        help="seconds a step waits for cache when it is full, before it is refused")
    parser.add_argument("--max-request-tokens", type=int, default=Limits.max_request_tokens,
                        help="most tokens (rows x positions) one request may carry")
    parser.add_argument("--max-session-tokens", type=int, default=Limits.max_session_tokens,
                        help="most cache one session may grow to, in tokens (max_length x batch_size)")
    parser.add_argument("--max-sessions-per-peer", type=int, default=Limits.max_sessions_per_peer,
                        help="most sessions one client peer may have open here at once")
    parser.add_argument("--allowed-clients", nargs="*", default=list(settings.allowed_clients),
                        help="peer ids of the only clients this server serves (default: anyone; ALLOWED_CLIENTS); "
                             "the servers of ALLOWED_SERVERS may push steps to it too")
    parser.add_argument("--max-batch-tokens", type=int, default=1024,
                        help="most tokens in one batched forward (decode steps of all sessions + prefill chunks)")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=128,
                        help="most prompt tokens per forward: a long prompt runs in chunks between decode steps")
    parser.add_argument("--dht-prefix", help="the model's name in the DHT (default: from --model)")
    parser.add_argument("--announce-period", type=float, default=settings.announce_period)
    parser.add_argument("--rebalance-period", type=float,
                        help="every this many seconds, consider moving to a span the swarm serves less "
                             "(default: 6 announce periods with --num-blocks, off with --blocks; 0: off)")
    parser.add_argument("--threads", type=int, default=settings.torch_threads,
                        help="torch threads for compute (default: TORCH_THREADS, else torch's choice)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics on http://HOST:PORT/metrics (default 0: off)")
    args = parser.parse_args(argv)

    if args.num_blocks is not None and args.num_blocks < 1:
        parser.error("--num-blocks must be at least 1")
    for name in ("cache_tokens", "max_batch_tokens", "prefill_chunk_tokens", "max_request_tokens",
                 "max_session_tokens", "max_sessions_per_peer"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_session_tokens > args.max_request_tokens:  # after a failover, a client replays a whole session
        parser.error("--max-session-tokens must not exceed --max-request-tokens: a client replays a session's "
                     "inputs in one request when it moves the session to this server")
    if args.cache_wait < 0:
        parser.error("--cache-wait must not be negative")
    if args.rebalance_period is None:
        args.rebalance_period = 6 * args.announce_period if args.num_blocks else 0.0
    if args.rebalance_period < 0 or args.announce_period <= 0:
        parser.error("--announce-period must be positive and --rebalance-period not negative")
    if not 0 <= args.metrics_port <= 65535:
        parser.error(f"--metrics-port must be a TCP port (0 for off), got {args.metrics_port}")
    if not args.initial_peers:
        parser.error("--initial-peers is required (or set INITIAL_PEERS): start a bootstrap peer with python -m swarm.dht")
    try:
        args.device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r} is not a device (use cpu, cuda or cuda:N)")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device} asked for, but CUDA is not available on this machine")
    args.dtype = getattr(torch, args.dtype)
    args.cache_dir = settings.cache_dir
    args.allowed_servers = settings.allowed_servers
    return args


def main(argv=None) -> None:
    from swarm.cli import run_main, setup_logging

    args = parse_args(argv)
    setup_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    run_main(lambda: asyncio.run(serve(args)))


if __name__ == "__main__":
    main()
