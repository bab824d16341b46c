"""A block server's settings: one frozen dataclass, built once from the command line (and config's defaults).

    python -m swarm.server --model NAME_OR_PATH --blocks START:END --initial-peers MADDR [...]

Light to import (torch loads only once the flags are checked): a wrong flag is told at once.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from swarm.protocol import MAX_ADAPTERS
from swarm.server.latency import SimulatedLatency

if TYPE_CHECKING:
    import torch

# a prompt's tokens per forward: a GPU computes 512 at about the cost of one decode round (a 512-token prompt
# in one chunk per server), a CPU's chunk must stay short for the decoding sessions waiting behind it
GPU_PREFILL_CHUNK, CPU_PREFILL_CHUNK = 512, 128


@dataclass(frozen=True)
class ServerLimits:
    """What any one client may ask of the server: every request comes from a peer nobody vetted."""

    max_request_tokens: int = 8192  # rows x positions of one request: a step, a push, a cache-less forward
    max_session_tokens: int = 8192  # max_length x batch_size of one session: the most cache it may grow to
    max_sessions_per_peer: int = 256  # open at once from one peer (a gateway is one peer for all its users)
    cache_wait: float = 3.0  # seconds a step waits for cache when it is full, before it is refused
    session_idle_timeout: float = 600.0  # seconds without a step after which a session is closed (0: never)
    # the part of the cache one peer may hold while other peers hold some too (1: no limit); see take_cache
    max_cache_share_per_peer: float = 0.5
    # the part of the cache that sessions parked by their clients (kept warm for reuse) may hold; see warm.py
    warm_cache_share: float = 0.5


QUANTIZATIONS = ("int8", "nf4")  # bitsandbytes' weight formats (swarm/server/quantize.py)

# (flag, type, help) of the limits on one client; their defaults are ServerLimits'
LIMIT_FLAGS = (
    ("--max-request-tokens", int, "most tokens (rows x positions) one request may carry"),
    ("--max-session-tokens", int, "most cache one session may grow to, in tokens (max_length x batch_size)"),
    ("--max-sessions-per-peer", int, "most sessions one client peer may have open here at once"),
    ("--cache-wait", float, "seconds a step waits for cache when it is full, before it is refused"),
    ("--session-idle-timeout", float, "seconds without a step after which a session is closed and its cache "
                                      "freed (0: never)"),
    ("--max-cache-share-per-peer", float, "the part of the cache (0-1] one client peer may hold while other peers "
                                          "use this server too, never less than one session of "
                                          "--max-session-tokens; a peer alone may use it all (1: no limit)"),
    ("--warm-cache-share", float, "the part of the cache [0-1] that sessions parked by their clients (kept warm "
                                  "for reuse) may hold; past it, or whenever a session needs room, they are "
                                  "closed least recently used first (0: none is kept)"),
)


@dataclass(frozen=True)
class ServerSettings:
    model: str
    blocks: Optional[tuple[int, int]]  # a fixed span, or None to choose `num_blocks` blocks the swarm lacks
    num_blocks: Optional[int]  # None with blocks None too: as many as memory fits (swarm/server/sizing.py)
    initial_peers: tuple[str, ...]
    host: str
    port: int
    identity: Optional[str]
    device: torch.device
    dtype: torch.dtype
    quantization: Optional[str]
    cuda_graphs: bool  # decode rounds replay captured CUDA graphs (on a CUDA device, unquantized)
    cache_tokens: int
    limits: ServerLimits
    allowed_clients: tuple[str, ...]
    allowed_servers: tuple[str, ...]
    max_batch_tokens: int
    prefill_chunk_tokens: int
    dht_prefix: Optional[str]
    announce_period: float
    rebalance_period: float  # 0: never move
    threads: Optional[int]
    metrics_port: int
    cache_dir: Path
    latency: SimulatedLatency = SimulatedLatency()  # --simulated-latency (off: 0)
    revision: str = "main"  # of a model named by its Hugging Face Hub id: a branch, tag or commit
    adapters: tuple[Path, ...] = ()  # PEFT LoRA adapter folders it applies on request (swarm/server/adapters.py)
    # public peers to be reached through (--relay-through): the server accepts no inbound connection (behind a NAT)
    relay_through: tuple[str, ...] = ()
    serve_as_relay: bool = False  # --serve-as-relay: a public server that relays for servers behind a NAT
    memory_budget: Optional[float] = None  # GiB its blocks may fill when it sizes its span (default: what is free)
    # multiaddrs announced instead of the listening ones (--public-address, --announce-maddrs): a forwarded port
    announce_maddrs: tuple[str, ...] = ()

    @property
    def allowed_peers(self) -> tuple[str, ...]:
        """A private server takes requests from its clients, and pushes from the other servers of its swarm."""
        return (*self.allowed_clients, *self.allowed_servers) if self.allowed_clients else ()


def parse_settings(argv=None) -> ServerSettings:
    """The settings of the command line `argv`; a wrong value exits with one line naming the flag."""
    from swarm.cli import settings_from_env

    defaults = settings_from_env()
    parser = _parser(defaults)
    args = parser.parse_args(argv)
    _check(parser, args)
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r} is not a device (use cpu, cuda or cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device} asked for, but CUDA is not available on this machine")
    limits = ServerLimits(**{field.name: getattr(args, field.name) for field in fields(ServerLimits)})
    rebalance = args.rebalance_period
    if rebalance is None:
        rebalance = 6 * args.announce_period if args.blocks is None else 0.0
    return ServerSettings(
        model=args.model, revision=args.revision, blocks=args.blocks, num_blocks=args.num_blocks,
        initial_peers=tuple(args.initial_peers),
        host=args.host, port=args.port, identity=args.identity, device=device, dtype=getattr(torch, args.dtype),
        quantization=args.quantize, cuda_graphs=args.cuda_graphs, cache_tokens=args.cache_tokens, limits=limits,
        allowed_clients=tuple(args.allowed_clients), allowed_servers=tuple(defaults.allowed_servers),
        max_batch_tokens=args.max_batch_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens or (GPU_PREFILL_CHUNK if device.type == "cuda" else
                                                           CPU_PREFILL_CHUNK),
        dht_prefix=args.dht_prefix, announce_period=args.announce_period, rebalance_period=rebalance,
        threads=args.threads, metrics_port=args.metrics_port, cache_dir=defaults.cache_dir,
        latency=_latency(parser, args),
        adapters=tuple(Path(folder) for folder in args.adapters), relay_through=tuple(args.relay_through),
        serve_as_relay=args.serve_as_relay, memory_budget=args.memory_budget,
        announce_maddrs=_announce_maddrs(parser, args),
    )


def _parser(defaults):
    from swarm.cli import ArgumentParser, multiaddr

    parser = ArgumentParser(prog="python -m swarm.server", description="Serve a span of a model's blocks.")
    _add_model_flags(parser, defaults)
    _add_span_flags(parser)
    parser.add_argument("--initial-peers", nargs="*", type=multiaddr, default=list(defaults.initial_peers))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--identity", help="a key file, created if missing, that keeps the peer id stable")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--quantize", choices=QUANTIZATIONS,
                        help="store the blocks' linear weights in 8 bits (int8) or 4 bits (nf4) with bitsandbytes")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="on a CUDA device, replay decode rounds as captured CUDA graphs (default: on)")
    parser.add_argument("--cache-tokens", type=int, default=defaults.cache_tokens,
                        help="attention cache budget, in token slots (sessions take them a page at a time)")
    for flag, kind, help_text in LIMIT_FLAGS:
        parser.add_argument(flag, type=kind, default=getattr(ServerLimits, flag[2:].replace("-", "_")), help=help_text)
    parser.add_argument("--allowed-clients", nargs="*", default=list(defaults.allowed_clients),
                        help="peer ids of the only clients this server serves (default: anyone; ALLOWED_CLIENTS); "
                             "the servers of ALLOWED_SERVERS may push steps to it too")
    parser.add_argument("--max-batch-tokens", type=int, default=1024,
                        help="most tokens in one batched forward (decode steps of all sessions + prefill chunks)")
    parser.add_argument("--prefill-chunk-tokens", type=int,
                        help="most prompt tokens per forward: a long prompt runs in chunks between decode steps "
                             f"(default: {GPU_PREFILL_CHUNK} on a GPU, {CPU_PREFILL_CHUNK} on a CPU, where a chunk "
                             "takes as long as a GPU's of several times its length)")
    parser.add_argument("--adapters", nargs="*", default=[], metavar="PATH",
                        help="PEFT LoRA adapter folders of this model: the server applies the adapter a request "
                             "names (by its folder's name) to its blocks, and announces them")
    parser.add_argument("--dht-prefix", help="the model's name in the DHT (default: from --model)")
    parser.add_argument("--announce-period", type=float, default=defaults.announce_period)
    parser.add_argument("--rebalance-period", type=float,
                        help="every this many seconds, consider moving to a span the swarm serves less "
                             "(default: 6 announce periods with --num-blocks, off with --blocks; 0: off)")
    parser.add_argument("--threads", type=int, default=defaults.torch_threads,
                        help="torch threads for compute (default: TORCH_THREADS, else torch's choice)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics on http://HOST:PORT/metrics (default 0: off)")
    _add_latency_flags(parser, defaults.simulated_latency_ms, defaults.network_map)
    _add_relay_flags(parser)
    _add_address_flags(parser)
    return parser


def _add_model_flags(parser, defaults) -> None:
    parser.add_argument("--model", default=defaults.model,
                        help="a known model name, a local Hugging Face folder, or a Hugging Face Hub id (ORG/NAME: "
                             "its config, tokenizer and the weight files of this server's blocks only are fetched "
                             "into the Hub's cache, HF_HOME; HF_TOKEN for a gated model, HF_HUB_OFFLINE=1 for the "
                             "cache alone) (default: MODEL)")
    parser.add_argument("--revision", default=defaults.revision,
                        help="of a Hub model: the branch, tag or commit to serve (default: MODEL_REVISION, else main)")


def _add_span_flags(parser) -> None:
    from swarm.cli import parse_block_range

    span = parser.add_mutually_exclusive_group()
    span.add_argument("--blocks", type=parse_block_range, help="START:END, the half-open range of blocks to hold")
    span.add_argument("--num-blocks", type=int,
                      help="hold N blocks, choosing the span the swarm serves least (without --blocks or "
                           "--num-blocks: as many as the device's memory fits, after the cache of --cache-tokens)")
    parser.add_argument("--memory-budget", type=float, metavar="GIB",
                        help="without --blocks or --num-blocks: the GiB of device memory the blocks, their cache and "
                             "their working memory may fill (default: the GPU's free memory, or the available RAM)")


def _add_address_flags(parser) -> None:
    parser.add_argument("--public-address", metavar="HOST[:PORT]",
                        help="for a box behind a forwarded port: announce this address (an IP or a DNS name; PORT "
                             "defaults to --port) to the swarm instead of the ones it listens on, so that clients "
                             "dial it")
    parser.add_argument("--announce-maddrs", nargs="+", default=[], metavar="MADDR",
                        help="announce these multiaddrs (e.g. /ip4/203.0.113.7/tcp/31337, without /p2p/) instead of "
                             "the ones it listens on (with --public-address: besides it)")


def _add_relay_flags(parser) -> None:
    from swarm.cli import multiaddr

    parser.add_argument("--relay-through", nargs="+", type=multiaddr, default=[], metavar="MADDR",
                        help="for a server that accepts no inbound connection (behind a NAT or a firewall): be reached "
                             "through these public peers of the swarm (a bootstrap peer, or a server with "
                             "--serve-as-relay), at addresses every client can dial (one is enough; more, for when "
                             "one is down); the server announces "
                             "itself as relayed, and clients route through it only where it pays")
    parser.add_argument("--serve-as-relay", action="store_true",
                        help="a server on a public address: relay for servers that accept no inbound connection "
                             "(their traffic then goes through this server's network too)")


def _add_latency_flags(parser, default_ms: float, default_map) -> None:
    parser.add_argument("--simulated-latency", type=float, default=default_ms, metavar="MS",
                        help="for tests and benchmarks on one machine: add MS milliseconds of round trip to every "
                             "exchange with this server (each message received is held MS/2, each sent MS/2; "
                             "messages in flight overlap, as on a network) (default: SIMULATED_LATENCY_MS, else 0: "
                             "off)")
    parser.add_argument("--simulated-latency-jitter", type=float, default=0.0, metavar="MS",
                        help="add a uniform random 0..MS ms more per round trip (0..MS/2 per message); messages of "
                             "one stream keep their order")
    parser.add_argument("--simulated-latency-seed", type=int, default=0, metavar="N",
                        help="seed of the jitter's draws (the same seed, the same delays)")
    parser.add_argument("--network-map", default=default_map, metavar="MAP",
                        help="for tests and benchmarks on one machine: a simulated network map (JSON, inline or a "
                             "file: regions, a round trip per pair of regions, jitter, seed; see docs/wan.md), each "
                             "message delayed by the link it crosses (default: NETWORK_MAP)")
    parser.add_argument("--region", metavar="NAME",
                        help="this server's region of --network-map (default: the map's default_region)")


def _latency(parser, args) -> SimulatedLatency:
    """--simulated-latency's, or a network map's delays (--network-map and --region): one or the other."""
    from swarm.network_map import NetworkMapError, parse_network_map, parse_region

    if args.network_map is None:
        if args.region:
            parser.error("--region needs --network-map (or NETWORK_MAP)")
        return SimulatedLatency(args.simulated_latency, args.simulated_latency_jitter, args.simulated_latency_seed)
    if args.simulated_latency or args.simulated_latency_jitter:
        parser.error("--network-map and --simulated-latency (or SIMULATED_LATENCY_MS): use one or the other")
    try:
        network_map = parse_network_map(args.network_map, "--network-map")
        region = parse_region(args.region, network_map, "--region")
    except NetworkMapError as error:
        parser.error(str(error))
    region = region or network_map.default_region  # NETWORK_MAP alone: the gateway's own local swarm, say
    if region is None:
        parser.error("--network-map needs --region (or a default_region in the map): this server's region")
    from swarm.server.links import MappedLatency

    return MappedLatency(network_map, region)


def _announce_maddrs(parser, args) -> tuple[str, ...]:
    """--public-address's multiaddr, then --announce-maddrs': what the server announces (none: where it listens)."""
    from swarm.server.addresses import AddressError, announce_maddr, public_maddr

    try:
        public = [public_maddr(args.public_address, args.port)] if args.public_address is not None else []
        return tuple(dict.fromkeys([*public, *map(announce_maddr, args.announce_maddrs)]))
    except AddressError as error:
        parser.error(str(error))


def _check(parser, args) -> None:
    if args.num_blocks is not None and args.num_blocks < 1:
        parser.error("--num-blocks must be at least 1")
    if args.memory_budget is not None and not 0 < args.memory_budget < math.inf:  # NaN fails too
        parser.error(f"--memory-budget must be a positive, finite number of GiB, got {args.memory_budget:g}")
    if args.memory_budget is not None and (args.blocks or args.num_blocks):
        parser.error("--memory-budget sizes the span a server chooses: give it without --blocks or --num-blocks")
    if (args.public_address or args.announce_maddrs) and args.relay_through:
        parser.error("--public-address and --announce-maddrs are for a server clients dial; one reached through "
                     "--relay-through announces its relays' circuit addresses")
    for name in ("cache_tokens", "max_batch_tokens", "prefill_chunk_tokens", "max_request_tokens",
                 "max_session_tokens", "max_sessions_per_peer"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_session_tokens > args.max_request_tokens:  # after a failover, a client replays a whole session
        parser.error("--max-session-tokens must not exceed --max-request-tokens: a client replays a session's "
                     "inputs in one request when it moves the session to this server")
    for name in ("cache_wait", "session_idle_timeout"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative")
    if args.session_idle_timeout == float("inf"):
        parser.error("--session-idle-timeout must be finite (0: never)")
    if not 0 < args.max_cache_share_per_peer <= 1:
        parser.error(f"--max-cache-share-per-peer must be in (0, 1], got {args.max_cache_share_per_peer:g}")
    if not 0 <= args.warm_cache_share <= 1:
        parser.error(f"--warm-cache-share must be in [0, 1], got {args.warm_cache_share:g}")
    if (args.rebalance_period is not None and args.rebalance_period < 0) or args.announce_period <= 0:
        parser.error("--announce-period must be positive and --rebalance-period not negative")
    for flag in ("simulated_latency", "simulated_latency_jitter"):
        if not 0 <= getattr(args, flag) <= 60000:  # NaN fails too
            parser.error(f"--{flag.replace('_', '-')} must be between 0 and 60000 ms, got {getattr(args, flag):g}")
    if len(args.adapters) > MAX_ADAPTERS:
        parser.error(f"--adapters: at most {MAX_ADAPTERS} adapters per server, got {len(args.adapters)}")
    if not 0 <= args.metrics_port <= 65535:
        parser.error(f"--metrics-port must be a TCP port (0 for off), got {args.metrics_port}")
    if args.relay_through and args.serve_as_relay:
        parser.error("--serve-as-relay is for a public server: a server reached through a relay cannot relay")
    if not args.initial_peers:
        parser.error("--initial-peers is required (or set INITIAL_PEERS): start a bootstrap peer with python -m swarm.dht")
