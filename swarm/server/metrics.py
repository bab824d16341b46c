"""Prometheus metrics of a block server: its sessions, cache, batches and steps.

They live in a registry of their own, served by prometheus_client's HTTP server when the server runs with
--metrics-port, so that a process that imports this module (a test, a gateway) exposes none of them.
Importing this module only creates metric objects: no thread, no socket.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

from swarm import gc_tuning

SERVER_REGISTRY = CollectorRegistry()
for _collector in (ProcessCollector, PlatformCollector, GCCollector):  # what the default registry would show
    _collector(registry=SERVER_REGISTRY)
gc_tuning.expose(SERVER_REGISTRY)

SESSIONS = Gauge("swarm_server_open_sessions", "Inference sessions open on this server", registry=SERVER_REGISTRY)
CACHE_TOKENS_USED = Gauge("swarm_server_cache_tokens_used", "Attention cache token slots reserved by open sessions",
                          registry=SERVER_REGISTRY)
CACHE_TOKENS_FREE = Gauge("swarm_server_cache_tokens_free", "Attention cache token slots free for new sessions",
                          registry=SERVER_REGISTRY)
BATCH_SIZE = Histogram("swarm_server_batch_size", "Sequences in one forward pass through the span",
                       buckets=(1, 2, 4, 8, 16, 32, 64), registry=SERVER_REGISTRY)
GRAPH_ROUNDS = Counter("swarm_server_graph_rounds_total", "Compute rounds that replayed a captured CUDA graph",
                       registry=SERVER_REGISTRY)
EAGER_ROUNDS = Counter("swarm_server_eager_rounds_total",
                       "Compute rounds run eagerly (kernel by kernel), by reason: prefill (a prompt's chunk or a "
                       "cache-less forward), adapter (a LoRA adapter's rows), other range (blocks other than the "
                       "span's whole range, past the captures they may have), size (more rows or keys than any "
                       "graph), capture failed, no graphs (a CPU or quantized span, or --no-cuda-graphs)",
                       ["reason"], registry=SERVER_REGISTRY)
STEP_SECONDS = Histogram(
    "swarm_server_step_seconds", "Time of one forward pass through the span, queueing for the compute thread included",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=SERVER_REGISTRY,
)
POSITIONS_SERVED = Counter("swarm_server_positions_served_total",
                           "Positions run through inference sessions (re-sent ones included)", registry=SERVER_REGISTRY)
PUSHES_FAILED = Counter("swarm_server_pushes_failed_total",
                        "Steps' outputs pushed to the next server of a chain that it did not take, by reason "
                        "(unreachable: the push failed; refused: the server answered with an error)", ["reason"],
                        registry=SERVER_REGISTRY)
INTERNAL_ERRORS = Counter("swarm_server_internal_errors_total",
                          "Failures of the server's own (a bug, out of memory), each logged at ERROR with its traceback: "
                          "compute rounds (once per round, whatever the number of its requests) and requests that "
                          "failed in the handler", ["where"], registry=SERVER_REGISTRY)
SESSIONS_CLOSED = Counter("swarm_server_sessions_closed_total",
                          "Sessions the server closed on its own, by reason (idle: no step for --session-idle-timeout; "
                          "reclaimed: an idle session of a peer over its cache share, closed to make room for another "
                          "peer; evicted: a session its client parked, closed to make room or to keep parked "
                          "sessions within --warm-cache-share); their clients fail over", ["reason"],
                          registry=SERVER_REGISTRY)
for _where in ("compute", "handler"):  # shown at 0 from the start: an alert can tell 'none' from 'no data'
    INTERNAL_ERRORS.labels(_where)
for _reason in ("idle", "reclaimed", "evicted"):
    SESSIONS_CLOSED.labels(_reason)


def watch_cache(budget) -> None:
    """Read the cache gauges from the server's budget at scrape time, so they are never stale."""
    CACHE_TOKENS_FREE.set_function(lambda: budget.free)
    CACHE_TOKENS_USED.set_function(lambda: budget.total - budget.free)


def start_server_metrics(host: str, port: int):
    """Serve the block server's registry as Prometheus text on http://host:port/metrics (a daemon thread).

    Returns prometheus_client's HTTP server (call .shutdown() to stop it) and the address it serves."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=SERVER_REGISTRY)
    bound_host, bound_port = server.server_address[:2]
    return server, f"http://{bound_host}:{bound_port}/metrics"
