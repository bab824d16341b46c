"""Cache-less forwards of any size: one unary call while the request fits hivemind's unary messages, else a
stream of parts (rpc_forward_stream, as Petals' rpc_forward_stream).

hivemind refuses a unary message over 4 MiB before it leaves (about 1,800 tokens of a model of hidden size 576,
256 at 4096): that refusal is ours, not the server's, and must never count against a server. So a request is
sent as a unary call only well under that limit, and streamed otherwise; its reply is as large as it is.
"""

from __future__ import annotations

import asyncio
from typing import Optional

import torch
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.control import MAX_UNARY_PAYLOAD_SIZE

from swarm.client.stubs import call_forward, forward_metadata, forward_outputs
from swarm.protocol import ServerUnavailableError, SwarmError
from swarm.wire import PART_BYTES, BlockRPC, gather_parts, pack, split_parts, unpack

# a request of more bytes of hidden states streams: half of hivemind's 4 MiB, so that the message's framing,
# its metadata and a reply as large as the request fit whatever the tensor's shape
UNARY_MAX_BYTES = MAX_UNARY_PAYLOAD_SIZE
DRAIN_SECONDS = 5.0  # after its reply, how long a stream may take to end


async def forward_on(p2p, peer_id: str, hidden: torch.Tensor, start: int, end: int, timeout: float,
                     adapter: Optional[str] = None) -> torch.Tensor:
    """Blocks [start, end) of one server (through a LoRA `adapter` of it, if any) on whole sequences (batch,
    length, hidden), nothing kept there."""
    if hidden.numel() * hidden.element_size() <= UNARY_MAX_BYTES:
        return await call_forward(p2p, peer_id, hidden, start, end, timeout, adapter)
    return await _streamed_forward(p2p, peer_id, hidden, start, end, timeout, adapter)


async def _streamed_forward(p2p, peer_id: str, hidden: torch.Tensor, start: int, end: int,
                            timeout: float, adapter: Optional[str]) -> torch.Tensor:
    stub = BlockRPC.get_stub(p2p, PeerID.from_base58(peer_id))
    parts = split_parts(pack((hidden,), forward_metadata(start, end, adapter)))
    size = hidden.numel() * hidden.element_size()  # the reply is as large: a server may send no more
    try:
        async with asyncio.timeout(timeout):
            replies = await stub.rpc_forward_stream(_iterate(parts))
            try:
                response = await gather_parts(replies, hidden.numel(), size + PART_BYTES)
            finally:
                await _read_to_end(replies)
    except Exception as error:  # timeouts, a broken stream, a reply that does not add up
        reason = "did not answer in time" if isinstance(error, TimeoutError) else f"failed: {error!r}"
        raise ServerUnavailableError(f"server {peer_id} {reason} (blocks {start}:{end})") from None
    try:
        answer = unpack(response) if response is not None else ([], {})
    except SwarmError as error:
        raise ServerUnavailableError(f"server {peer_id} sent an undecodable reply: {error}") from None
    return forward_outputs(answer, hidden, peer_id, start, end)


async def _read_to_end(replies) -> None:
    """hivemind retrieves the failure of the task writing our parts (a server that refused early and hung up)
    only at the stream's end: read to it, so that asyncio does not log it as never retrieved."""
    try:
        async with asyncio.timeout(DRAIN_SECONDS):
            async for _ in replies:
                pass
    except Exception:  # the reply, if any, is what counts
        pass
    finally:
        await replies.aclose()


async def _iterate(parts: list):
    for part in parts:
        yield part
