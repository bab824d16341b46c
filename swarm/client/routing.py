"""Pure choices over what servers announced: which chain of servers serves a session."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Optional

from swarm.protocol import MissingBlocksError, RemoteServer, format_block_ranges, missing_ranges


@dataclass(frozen=True)
class ChainLink:
    """One hop of a chain: this server runs blocks [start, end) (maybe only part of what it holds)."""

    peer_id: str
    start: int
    end: int


def choose_chain(
    servers: Collection[RemoteServer],
    num_blocks: int,
    model_name: str,
    exclude: Collection[str] = (),
    start: int = 0,
    load: Optional[Mapping[str, float]] = None,
    min_cache_tokens: int = 0,
) -> list[ChainLink]:
    """A chain covering blocks [start, num_blocks): fewest hops first, then the least estimated time per token.

    Each hop runs from the current block to the end of some server's span: going as far as possible never
    costs an extra hop, and a server may be entered in the middle of its span. `load[peer]` multiplies a
    server's estimated time (the client's own view: observed latency, sessions it already has there);
    servers announcing less free cache than `min_cache_tokens` are left out while others can serve.
    """
    servers = [server for server in servers if server.peer_id not in exclude]
    roomy = [server for server in servers if server.info.cache_tokens_free >= min_cache_tokens]
    if not missing_ranges(roomy, num_blocks, start):
        servers = roomy
    missing = missing_ranges(servers, num_blocks, start)
    if missing:
        raise MissingBlocksError(f"no server holds blocks {format_block_ranges(missing)} of {model_name}")
    load = load or {}

    # best[position] = (hops, seconds per token, previous position, link); positions only grow: a DAG
    best: list = [None] * (num_blocks + 1)
    best[start] = (0, 0.0, None, None)
    for position in range(start, num_blocks):
        if best[position] is None:
            continue
        hops, seconds, _, _ = best[position]
        for server in servers:
            info = server.info
            if not info.start <= position < info.end:
                continue
            end = min(info.end, num_blocks)  # a chain may stop before the model's last block (embeddings)
            share = (end - position) / (info.end - info.start)
            estimate = share / max(info.throughput, 1e-9) * load.get(server.peer_id, 1.0)
            candidate = (hops + 1, seconds + estimate)
            if best[end] is None or candidate < best[end][:2]:
                best[end] = (*candidate, position, ChainLink(server.peer_id, position, end))

    chain, position = [], num_blocks
    while position > start:
        _, _, previous, link = best[position]
        chain.append(link)
        position = previous
    return chain[::-1]
