"""Opening a session's servers (a RemoteSession's: swarm/client/remote_session.py): the best chain over a range of blocks, each of its
servers' sessions opened at once, and routed around again past every server that refuses (a full cache, a
private server) or fails, until one chain opens whole."""

from __future__ import annotations

import asyncio
import logging
from typing import Collection

from swarm.client.hops import Hop
from swarm.client.routing import ChainLink
from swarm.client.stubs import InferenceStream
from swarm.protocol import (PAGE_TOKENS, CacheFullError, InternalServerError, MissingBlocksError, NotAllowedError,
                            ServerUnavailableError)

logger = logging.getLogger(__name__)

# a server at fault: dead, stalled, cut off, lying (spot checks), or failed on its own (out of memory, a bug);
# a session bans it and goes on elsewhere, replaying what it had sent there
SERVER_FAULTS = (ServerUnavailableError, InternalServerError)


def open_hops(session, start: int, end: int, full: Collection[str] = (), replan: bool = True) -> list[Hop]:
    """Streams to the best chain over blocks [start, end), around servers whose cache is `full` (and any
    found full or unreachable on the way). `replan`: a session's servers are being replaced, not opened:
    routing goes by the client's view of the swarm as long as its records live (swarm/client/swarm_view.py),
    with no lookup of its own."""
    services = session.services
    full, unreachable = set(full), set()  # full: its cache (or a limit), or it does not serve us
    last_refusal = ""
    while True:
        chain = _route(session, start, end, full, unreachable, last_refusal, replan)
        replan = True  # routing around refusals goes by the same view
        hops = [Hop(link, InferenceStream(services.p2p, link.peer_id, link.start, link.end, services.open_timeout,
                                          services.step_channels), declared=session.next_positions)
                for link in chain]
        for link in chain:
            services.load.opened(link.peer_id)
        refusals = services.loop.run(_open_streams(session, hops))
        if not refusals:
            return hops
        for hop in hops:  # the servers that did open free their cache at once
            session.close_hop(hop)
        for link, error in refusals:
            # full, failing, or private (NotAllowedError: a server not for this client): go elsewhere
            if not isinstance(error, (CacheFullError, *SERVER_FAULTS, NotAllowedError)):
                raise error
            logger.info("routing around server %s: %s", link.peer_id, error)
            if isinstance(error, SERVER_FAULTS):
                unreachable.add(link.peer_id)
                services.bans.ban(link.peer_id)
            else:
                full.add(link.peer_id)
                last_refusal = f" (the last one: {error})"

async def _open_streams(session, hops: list[Hop]) -> list[tuple[ChainLink, BaseException]]:
    """Open every hop's session at once: a chain's opening costs one server's round trips, not the sum of
    all of theirs (two each: the stream, then the opening message). Returns each hop that failed, with why."""
    outcomes = await asyncio.gather(*(hop.stream.open(session.max_length, session.batch_size, adapter=session.route.adapter,
                                                      next_positions=session.next_positions) for hop in hops),
                                    return_exceptions=True)
    return [(hop.link, outcome) for hop, outcome in zip(hops, outcomes) if isinstance(outcome, BaseException)]

def _route(session, start: int, end: int, full: set[str], unreachable: set[str], last_refusal: str,
           replan: bool) -> list[ChainLink]:
    """The best chain over blocks [start, end) around those servers; while no server holds some of the
    blocks, wait for one (the client's block_wait at most)."""
    services, route = session.services, session.route
    # servers take cache a page at a time as the session grows: what matters is room for the first
    routing = dict(exclude=full | unreachable, end=end, start=start, adapter=route.adapter,
                   min_cache_tokens=min(session.max_length, PAGE_TOKENS) * session.batch_size, replan=replan,
                   opening=not replan)
    if not full:
        return services.wait_for_chain(route.prefix, route.num_blocks, route.model_name, **routing,
                                     on_wait=session.on_wait)
    try:  # no waiting: servers could serve, were their caches not full
        return services.find_chain(route.prefix, route.num_blocks, route.model_name, **routing)
    except MissingBlocksError:  # servers with a full cache could have served: the error worth reporting
        raise CacheFullError(f"every server that could serve blocks {start}:{end} of "
                             f"{route.model_name} has a full cache or failed{last_refusal}") from None
