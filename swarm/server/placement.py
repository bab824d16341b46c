"""Where a block server sits in the swarm: the span it claims when it starts with --num-blocks, and when it
should move to a span the swarm serves less (with hysteresis: see span_to_move_to)."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Iterable, Optional

from swarm import dht
from swarm.protocol import RemoteServer, ServerInfo, ServerState, servers_per_block

logger = logging.getLogger(__name__)

CLAIM_ROUNDS = 10  # rounds end once no rival overlaps twice in a row: more only bound a slow DHT's worst case
CONFIRM_ROUNDS = 2


async def live_others(node, prefix: str, num_blocks: int) -> list[RemoteServer]:
    """Every other server that serves or is about to serve some blocks (online or joining)."""
    me = dht.peer_id_of(node)
    servers = await dht.fetch_all_servers(node, prefix, num_blocks)
    return [server for server in servers if server.peer_id != me and server.info.state != ServerState.OFFLINE]


async def claim_span(node, prefix: str, num_blocks: int, length: int, period: float) -> tuple[int, int]:
    """The least-served span of `length` blocks, announced as JOINING before the weights load.

    Servers started at the same moment would all see the same empty swarm and pick the same span: each
    announces its pick, waits a random moment, and yields the span to a rival with a smaller peer id.
    """
    me = dht.peer_id_of(node)
    await asyncio.sleep(random.uniform(0.0, 1.0))
    start, end = choose_span(await live_others(node, prefix, num_blocks), num_blocks, length)
    quiet = 0  # rounds in a row without a rival: a rival's claim may reach this node's DHT a round late
    for _ in range(CLAIM_ROUNDS):
        await dht.announce(node, prefix, ServerInfo(ServerState.JOINING, start, end, 0.0, 0), 3 * period)
        await asyncio.sleep(random.uniform(0.5, 1.5))
        others = await live_others(node, prefix, num_blocks)
        rivals = [server for server in others if server.info.state == ServerState.JOINING and server.peer_id < me
                  and server.info.start < end and start < server.info.end]
        if not rivals:
            quiet += 1
            if quiet == CONFIRM_ROUNDS:
                break
            continue
        quiet = 0
        logger.info("blocks %d:%d are being claimed by %s too; choosing again", start, end, rivals[0].peer_id)
        start, end = choose_span(others, num_blocks, length)
    return start, end


async def advised_move(node, prefix: str, num_blocks: int, me: ServerInfo) -> Optional[tuple[int, int]]:
    """The span this server should move to now, or None."""
    others = await live_others(node, prefix, num_blocks)
    return span_to_move_to(others, num_blocks, RemoteServer(dht.peer_id_of(node), me))


# ------------------------------------------------------------------------------------------- pure choices


def choose_span(servers: Iterable[RemoteServer], num_blocks: int, span_length: int) -> tuple[int, int]:
    """The span of `span_length` blocks that the swarm serves least (fewest servers per block, summed)."""
    span_length = min(span_length, num_blocks)
    counts = servers_per_block(servers, num_blocks)
    start = min(range(num_blocks - span_length + 1), key=lambda first: (sum(counts[first : first + span_length]), first))
    return start, start + span_length


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
