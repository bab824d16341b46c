"""The swarm's client: a model whose blocks run on remote servers, and the connection that routes to them.

In data-flow order:

    swarm_client.py  SwarmClient: a client-mode DHT node; finds servers, opens sessions, and answers what the
                     swarm looks like (catalogue, Coverage, SwarmHealth: dataclasses, so callers never touch the DHT)
    routing.py       pure choices: the chain of servers that serves a session (least expected step time: round
                     trips plus compute; chain_step_seconds)
    flowing_routes.py  the same for flowing steps: the client's link in and out once, and the servers'
                     announced round trips between them
    peers.py         Bans (peers left out for a while) and PeerLoad (the client's own view of each server: its
                     load, round trip, and compute per block)
    probes.py        round trips to the servers routing considers, timed (rpc_info); one not answering is banned
    stubs.py         the client's end of the block servers' RPC (swarm/wire.py): info, forward, inference streams,
                     and the per-server step channels that carry all sessions' steps to a server as one message
    forwards.py      cache-less forwards of any size: unary under hivemind's 4 MiB messages, streamed in parts above
    remote_session.py  RemoteSession: hidden states through the chain; on a failure ban, re-route, replay
                     (what it uses of its SwarmClient comes as ClientServices: it never imports swarm_client)
    spot_check.py    now and then, other servers recompute a hop of a step; a liar is banned
    head.py          the client's weights: embeddings, final norm, LM head (from the family's ClientSide)
    coalesce.py      concurrent row-wise calls merged into one (the LM head of sessions decoding at once)
    remote_model.py  RemoteModel: embeddings -> remote blocks -> norm -> LM head; session(max_length).step(ids)
    decoding.py      logits -> token (greedy, temperature, top-k, top-p), and a streaming detokenizer
    generate.py      `python -m swarm.client.generate`, an operator's quick check
    catalogue.py     `python -m swarm.client.catalogue`, the models a swarm serves
    metrics.py       Prometheus counters: retries, failovers, spot checks (in the default registry)
    stage_clock.py   where steps' time goes, stage by stage (engine loop, hand-off, each hop and its server's own
                     timings), summed for /metrics and bench.engine

The public API is what this module exports (__all__); the gateway imports nothing else of swarm but
swarm.protocol's errors and records. It never imports swarm.server. Importing it loads no torch, hivemind or
transformers: the names below load their modules when first used.
"""

from __future__ import annotations

import importlib

from swarm.client import metrics  # noqa: F401  (the client's counters exist, at 0, before any client does)

_EXPORTS = {
    "SwarmClient": "swarm.client.swarm_client",
    "Coverage": "swarm.client.swarm_client",
    "SwarmHealth": "swarm.client.swarm_client",
    "RemoteSession": "swarm.client.remote_session",
    "RemoteModel": "swarm.client.remote_model",
    "InferenceSession": "swarm.client.remote_model",
    "IncrementalDetokenizer": "swarm.client.decoding",
    "speaks": "swarm.client.routing",  # whether a server's protocol version is one this client talks to
    "resolve_model": "swarm.weights",  # a model's local folder (a known name converted once): a gateway's draft model
}
# logits -> token, as the gateway's sampling builds on them; where steps' time goes, which the engine adds to
_MODULES = {"decoding", "stage_clock"}
__all__ = [*_EXPORTS, *_MODULES, "metrics"]


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"swarm.client.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'swarm.client' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
