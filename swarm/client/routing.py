"""Pure choices over what servers announced: which chain of servers serves a session."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Optional

from swarm.protocol import MAX_THROUGHPUT, MissingBlocksError, RemoteServer, format_block_ranges, missing_ranges


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
    measured: Optional[Mapping[str, float]] = None,
) -> list[ChainLink]:
    """A chain covering blocks [start, num_blocks): fewest hops first, then the least estimated time per token.

    Each hop runs from the current block to the end of some server's span: going as far as possible never
    costs an extra hop, and a server may be entered in the middle of its span. A server's time per block is
    what the client `measured` there, else what it announced, within bounds (see seconds_per_block); `load[peer]`
    multiplies it. Servers announcing less free cache than `min_cache_tokens` are left out while others can serve.
    """
    servers = _routable(servers, num_blocks, model_name, exclude, start, min_cache_tokens)
    load, measured = load or {}, measured or {}
    speed = seconds_per_block(servers, measured)
    servers.sort(key=lambda server: server.peer_id not in measured)  # on a tie, a server measured goes first

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
            estimate = (end - position) * speed[server.peer_id] * load.get(server.peer_id, 1.0)
            candidate = (hops + 1, seconds + estimate)
            if best[end] is None or candidate < best[end][:2]:
                best[end] = (*candidate, position, ChainLink(server.peer_id, position, end))

    chain, position = [], num_blocks
    while position > start:
        _, _, previous, link = best[position]
        chain.append(link)
        position = previous
    return chain[::-1]


def _routable(servers: Collection[RemoteServer], num_blocks: int, model_name: str, exclude: Collection[str],
              start: int, min_cache_tokens: int) -> list[RemoteServer]:
    """The servers a chain may use: not excluded, and with room for the session if enough of them have it."""
    servers = [server for server in servers if server.peer_id not in exclude]
    roomy = [server for server in servers if server.info.cache_tokens_free >= min_cache_tokens]
    if not missing_ranges(roomy, num_blocks, start):
        servers = roomy
    missing = missing_ranges(servers, num_blocks, start)
    if missing:
        raise MissingBlocksError(f"no server holds blocks {format_block_ranges(missing)} of {model_name}")
    return servers


def seconds_per_block(servers: Iterable[RemoteServer], measured: Mapping[str, float]) -> dict[str, float]:
    """Each server's time per block of a decode step, as far as the client can trust it.

    What a server announces is only a claim (records parse within bounds, see ServerInfo.from_wire): once the
    client has measured a server, the claim can make it look slower, never faster, than measured; a server not
    measured yet is taken as no faster than the fastest one measured, so that a claim alone never outranks a
    speed the client has seen (it is tried when the measured ones are busier, and measured then).
    """
    claimed = {server.peer_id: 1.0 / (_believable(server.info.throughput) * (server.info.end - server.info.start))
               for server in servers}
    measured = {peer: seconds for peer, seconds in measured.items() if peer in claimed and math.isfinite(seconds)}
    floor = min(measured.values(), default=0.0)  # a claim faster than every measured server is believed that far
    return {peer: max(claim, measured.get(peer, floor)) for peer, claim in claimed.items()}


def _believable(throughput: float) -> float:
    """A claimed throughput within the records' bounds; anything else (NaN, inf, 0: not parsed from the DHT,
    but a record may be built by hand) counts as the slowest possible."""
    return min(throughput, MAX_THROUGHPUT) if math.isfinite(throughput) and throughput > 0 else 1e-9


def longest_session(servers: Iterable[RemoteServer], num_blocks: int) -> Optional[int]:
    """For each block, the best max_session_tokens among the servers holding it; the least of those over the
    blocks: the longest session a chain of these servers can hold. None if unknown (a block with no server, or
    only servers whose records predate the field)."""
    best: list[Optional[int]] = [None] * num_blocks
    for server in servers:
        tokens = server.info.max_session_tokens
        if tokens is None:
            continue
        for index in range(server.info.start, min(server.info.end, num_blocks)):
            best[index] = tokens if best[index] is None else max(best[index], tokens)
    return None if not best or None in best else min(best)
