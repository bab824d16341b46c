"""Pure choices over what servers announced: which chain serves a session, which span a new server takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Optional

from swarm.protocol import MissingBlocksError, RemoteServer, format_block_ranges


@dataclass(frozen=True)
class ChainLink:
    """One hop of a chain: this server runs blocks [start, end) (maybe only part of what it holds)."""

    peer_id: str
    start: int
    end: int


def missing_ranges(servers: Iterable[RemoteServer], num_blocks: int, start: int = 0) -> list[tuple[int, int]]:
    """Half-open ranges of blocks in [start, num_blocks) that no server holds."""
    covered = [index < start for index in range(num_blocks)]
    for server in servers:
        for index in range(server.info.start, min(server.info.end, num_blocks)):
            covered[index] = True
    ranges, start = [], None
    for index, is_covered in enumerate([*covered, True]):
        if not is_covered and start is None:
            start = index
        elif is_covered and start is not None:
            ranges.append((start, index))
            start = None
    return ranges


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


def choose_span(servers: Iterable[RemoteServer], num_blocks: int, span_length: int) -> tuple[int, int]:
    """The span of `span_length` blocks that the swarm serves least (fewest servers per block, summed)."""
    span_length = min(span_length, num_blocks)
    counts = servers_per_block(servers, num_blocks)
    start = min(range(num_blocks - span_length + 1), key=lambda first: (sum(counts[first : first + span_length]), first))
    return start, start + span_length


def servers_per_block(servers: Iterable[RemoteServer], num_blocks: int) -> list[int]:
    counts = [0] * num_blocks
    for server in servers:
        for index in range(server.info.start, min(server.info.end, num_blocks)):
            counts[index] += 1
    return counts


def span_to_move_to(others: list[RemoteServer], num_blocks: int, me: RemoteServer) -> Optional[tuple[int, int]]:
    """Where a server should move to even out the swarm, or None to stay (`others`: every other live server).

    Hysteresis, so that servers never flap: only a server whose every block another server also holds may
    move, only toward a block nobody serves or one served by at least 2 fewer servers than its own weakest
    block, and among servers sharing its span only the one with the greatest peer id moves at a time.
    """
    start, end = me.info.start, me.info.end
    counts = servers_per_block(others, num_blocks)
    if min(counts[start:end]) < 1:
        return None  # it is the only server of some of its blocks
    if any(server.info.start == start and server.info.end == end and server.peer_id > me.peer_id
           for server in others):
        return None  # a twin with a greater peer id moves first; this one stays
    target = choose_span(others, num_blocks, end - start)
    if target == (start, end):
        return None
    weakest_target, weakest_mine = min(counts[target[0]:target[1]]), min(counts[start:end])
    return target if weakest_target == 0 or weakest_mine - weakest_target >= 2 else None
