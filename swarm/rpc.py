"""The block server's RPC over libp2p: one servicer class gives both the server's handlers and the clients' stubs.

Messages are hivemind's ExpertRequest/ExpertResponse: tensors plus msgpack metadata.

    rpc_info       {} -> {start, end, dtype, device, cache_tokens_free, positions_served, steps_pushed, version,
                         loaded_names}
    rpc_forward    [hidden] {start, end} -> [hidden]                   cache-less, whole sequences
    rpc_inference  a stream: first {start, end, max_length, batch_size, session_id?} -> {ok}
                   then per step [hidden] {position, step_id?, push_to?: {peer_id, session_id}} -> [hidden]
                   closing the request stream ends the session and frees its cache
    rpc_push       [hidden] {session_id, step_id, position} -> {}: a step's inputs, pushed by the previous
                   server of the chain (named by the client in push_to) as soon as it has them, so that the
                   next server starts before the client's copy of the same inputs arrives

A refused request is answered with {"error": {code, message}} (see protocol.error_to_wire), never by a
broken stream, so the client can raise the same SwarmError the server raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import AsyncIterator, Collection, Optional

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

from swarm.protocol import (
    BadRequestError,
    NotAllowedError,
    ServerUnavailableError,
    SwarmError,
    error_from_wire,
    error_to_wire,
)

logger = logging.getLogger(__name__)

PUSH_TIMEOUT = 10.0
REFUSAL_LINGER = 5.0  # seconds a refused stream stays open for the client to end it


# hivemind widens bfloat16 to float32 on the wire; its bits travel as int16 instead, named under this key
BFLOAT16_KEY = "bfloat16_tensors"


def pack(tensors: tuple[torch.Tensor, ...] = (), metadata: Optional[dict] = None, request: bool = True):
    message = runtime_pb2.ExpertRequest() if request else runtime_pb2.ExpertResponse()
    bfloat16 = [index for index, tensor in enumerate(tensors) if tensor.dtype == torch.bfloat16]
    if bfloat16:
        metadata = {**(metadata or {}), BFLOAT16_KEY: bfloat16}
        tensors = tuple(tensor.view(torch.int16) if index in bfloat16 else tensor for index, tensor in enumerate(tensors))
    message.tensors.extend(serialize_torch_tensor(tensor) for tensor in tensors)
    message.metadata = MSGPackSerializer.dumps(metadata or {})
    return message


def unpack(message) -> tuple[list[torch.Tensor], dict]:
    # peers send tensors as they are: hivemind's compressed formats would only widen what a stranger can reach
    if any(tensor.compression != runtime_pb2.CompressionType.NONE for tensor in message.tensors):
        raise BadRequestError("tensors must travel uncompressed")
    try:
        metadata = MSGPackSerializer.loads(message.metadata) if message.metadata else {}
        tensors = [deserialize_torch_tensor(tensor) for tensor in message.tensors]
    except Exception as error:  # any garbage in a stranger's message
        raise BadRequestError(f"undecodable message: {error}") from None
    if not isinstance(metadata, dict):
        raise BadRequestError("message metadata must be a map")
    named = metadata.pop(BFLOAT16_KEY, None) or []
    for index in named if isinstance(named, list) else [named]:
        if not isinstance(index, int) or not 0 <= index < len(tensors) or tensors[index].dtype != torch.int16:
            raise BadRequestError(f"{BFLOAT16_KEY} must name int16 tensors of the message, got {index!r}")
        tensors[index] = tensors[index].view(torch.bfloat16)
    return tensors, metadata


def reply(tensors: tuple[torch.Tensor, ...] = (), metadata: Optional[dict] = None):
    return pack(tensors, metadata, request=False)


def error_reply(error: Exception):
    if not isinstance(error, SwarmError):
        logger.exception("request failed", exc_info=error)
        error = SwarmError("internal server error")  # details stay in the server's log
    return reply(metadata=error_to_wire(error))


class BlockService(ServicerBase):
    """Decodes requests, hands them to the server's backend (see server.Backend), encodes replies.

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
                await BlockService.get_stub(self.p2p, peer).rpc_push(pushed, timeout=PUSH_TIMEOUT)
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


def _raise_if_error(metadata: dict) -> None:
    error = error_from_wire(metadata)
    if error is not None:
        raise error


async def call_info(p2p, peer_id: str, timeout: float = 10.0) -> dict:
    stub = BlockService.get_stub(p2p, PeerID.from_base58(peer_id))
    response = await stub.rpc_info(pack(), timeout=timeout)
    _, metadata = unpack(response)
    _raise_if_error(metadata)
    return metadata


async def call_forward(p2p, peer_id: str, hidden: torch.Tensor, start: int, end: int, timeout: float) -> torch.Tensor:
    stub = BlockService.get_stub(p2p, PeerID.from_base58(peer_id))
    try:
        response = await stub.rpc_forward(pack((hidden,), {"start": start, "end": end}), timeout=timeout)
    except Exception as error:
        reason = "did not answer in time" if isinstance(error, asyncio.TimeoutError) else f"failed: {error!r}"
        raise ServerUnavailableError(f"server {peer_id} {reason} (blocks {start}:{end})") from None
    tensors, metadata = unpack(response)
    _raise_if_error(metadata)
    return tensors[0]


class InferenceStream:
    """The client's end of one server's inference session: push a step, await its reply."""

    def __init__(self, p2p, peer_id: str, start: int, end: int, timeout: float):
        self.p2p, self.peer_id, self.start, self.end, self.timeout = p2p, peer_id, start, end, timeout
        self.session_id = secrets.token_hex(16)  # what the previous server of the chain pushes steps to
        self._requests: asyncio.Queue = asyncio.Queue()
        self._responses = None

    async def open(self, max_length: int, batch_size: int) -> None:
        stub = BlockService.get_stub(self.p2p, PeerID.from_base58(self.peer_id))
        try:
            self._responses = await asyncio.wait_for(stub.rpc_inference(self._iterate_requests()), self.timeout)
        except Exception as error:
            raise ServerUnavailableError(f"server {self.peer_id} could not be reached: {error!r}") from None
        opening = {"start": self.start, "end": self.end, "max_length": max_length, "batch_size": batch_size,
                   "session_id": self.session_id}
        await self._exchange(pack(metadata=opening), self.timeout)

    async def step(self, hidden: torch.Tensor, position: int, timeout: Optional[float] = None, step_id: int = 0,
                   push_to: Optional["InferenceStream"] = None) -> torch.Tensor:
        """The outputs for these positions; a server silent for `timeout` seconds counts as failed (after
        a timeout the stream is out of step and must not be used again). With `push_to`, the server also
        pushes the outputs to that stream's server, which starts step `step_id` before the client sends it."""
        metadata = {"position": position, "step_id": step_id}
        if push_to is not None:
            metadata["push_to"] = {"peer_id": push_to.peer_id, "session_id": push_to.session_id}
        tensors, _ = await self._exchange(pack((hidden,), metadata), timeout or self.timeout)
        return tensors[0]

    async def close(self) -> None:
        self._requests.put_nowait(None)  # ends the request stream: the server frees the cache

    async def _exchange(self, request, timeout: float) -> tuple[list[torch.Tensor], dict]:
        self._requests.put_nowait(request)
        try:
            response = await asyncio.wait_for(anext(self._responses), timeout)
        except Exception as error:  # timeouts, a closed stream, any failure of the transport
            reason = "did not answer in time" if isinstance(error, asyncio.TimeoutError) else f"failed: {error!r}"
            raise ServerUnavailableError(f"server {self.peer_id} {reason} (blocks {self.start}:{self.end})") from None
        tensors, metadata = unpack(response)
        _raise_if_error(metadata)
        return tensors, metadata

    async def _iterate_requests(self):
        while (request := await self._requests.get()) is not None:
            yield request
