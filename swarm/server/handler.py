"""The block server's RPC handlers: decode requests, hand them to the backend, encode replies.

The messages are swarm/wire.py's; what a request may ask is checked by the backend (swarm/server/backend.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Collection, Optional

import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2

from swarm.protocol import BadRequestError, NotAllowedError, SwarmError, error_to_wire
from swarm.wire import BlockRPC, pack, reply, unpack

logger = logging.getLogger(__name__)

PUSH_TIMEOUT = 10.0
REFUSAL_LINGER = 5.0  # seconds a refused stream stays open for the client to end it


def error_reply(error: Exception):
    if not isinstance(error, SwarmError):
        logger.exception("request failed", exc_info=error)
        error = SwarmError("internal server error")  # details stay in the server's log
    return reply(metadata=error_to_wire(error))


class BlockHandler(BlockRPC):
    """Decodes requests, hands them to the server's backend (see swarm/server/backend.py), encodes replies.

    Every request may come from anyone: the backend checks what it carries; here, who sends it (a private
    server takes requests only from `allowed_peers`, if given) and that a stream steps only its own session."""

    def __init__(self, backend, allowed_peers: Collection[str] = ()):
        self.backend = backend
        self.allowed_peers = frozenset(allowed_peers)
        self.p2p = None  # set by add_p2p_handlers: pushes go out through it
        self._pushes: set[asyncio.Task] = set()

    async def add_p2p_handlers(self, p2p, *args, **kwargs) -> None:
        self.p2p = p2p
        await super().add_p2p_handlers(p2p, *args, **kwargs)

    async def rpc_info(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        try:
            self._check_caller(context)
            return reply(metadata=self.backend.info())
        except Exception as error:
            return error_reply(error)

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        try:
            self._check_caller(context)
            tensors, metadata = unpack(request)
            return reply((await self.backend.forward(tensors, metadata),))
        except Exception as error:
            return error_reply(error)

    async def rpc_push(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """A session's step, pushed by the previous server of its client's chain: it may name the session only
        by its random id, which the client gave only to that server."""
        try:
            self._check_caller(context)
            tensors, metadata = unpack(request)
            self.backend.accept_push(tensors, metadata)
            return reply()
        except Exception as error:
            return error_reply(error)

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            opening = await anext(requests)
            self._check_caller(context)
            _, metadata = unpack(opening)
            session = await self.backend.open_session(metadata, context.remote_id.to_base58())
        except StopAsyncIteration:
            return
        except Exception as error:
            yield error_reply(error)
            # then wait for the client to end its side (a bounded time): a stream that the server closes at once
            # sometimes loses the reply on its way through the libp2p daemons, and the client waits in vain
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(_drain(requests), REFUSAL_LINGER)
            return
        try:
            yield reply(metadata={"ok": True})
            async for request in requests:
                try:
                    tensors, metadata = unpack(request)
                    push_to = _push_target(metadata)  # checked first: a step must not run, then be refused
                    output = await session.step(tensors, metadata)
                    if push_to is not None:
                        self._push(push_to, metadata, output)
                    yield reply((output,))
                except Exception as error:  # a refused step leaves the session as it was
                    yield error_reply(error)
        finally:
            session.close()

    def _check_caller(self, context: P2PContext) -> None:
        if self.allowed_peers and context.remote_id.to_base58() not in self.allowed_peers:
            raise NotAllowedError(f"peer {context.remote_id.to_base58()} is not on this server's list of clients")

    def _push(self, target: tuple[PeerID, str], metadata: dict, output: torch.Tensor) -> None:
        """Send a step's outputs to the next server of the client's chain, beside the reply to the client."""
        peer, session_id = target
        pushed = pack((output,), {"session_id": session_id, "step_id": metadata.get("step_id"),
                                  "position": metadata.get("position")})

        async def push():
            try:
                await BlockRPC.get_stub(self.p2p, peer).rpc_push(pushed, timeout=PUSH_TIMEOUT)
            except Exception as error:  # the client's own copy of the inputs follows anyway
                logger.debug("push to %s failed: %r", peer, error)

        task = asyncio.ensure_future(push())
        self._pushes.add(task)  # a reference, so that the task is not collected while it runs
        task.add_done_callback(self._pushes.discard)


async def _drain(requests: AsyncIterator) -> None:
    async for _ in requests:
        pass


def _push_target(metadata: dict) -> Optional[tuple[PeerID, str]]:
    target = metadata.get("push_to")
    if target is None:
        return None
    if not (isinstance(target, dict) and isinstance(target.get("peer_id"), str)
            and isinstance(target.get("session_id"), str)):
        raise BadRequestError("field 'push_to' must be a map with a 'peer_id' and a 'session_id'")
    try:
        return PeerID.from_base58(target["peer_id"]), target["session_id"]
    except Exception:
        raise BadRequestError(f"push_to: {target['peer_id']!r} is not a peer id") from None


# ------------------------------------------------------------------------------------------- client side
