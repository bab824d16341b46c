"""The client's end of the block servers' RPC (swarm/wire.py): info, cache-less forwards, inference streams."""

from __future__ import annotations

import asyncio
import secrets
from typing import Optional

import torch
from hivemind.p2p import PeerID

from swarm.protocol import ServerUnavailableError
from swarm.wire import BlockRPC, pack, raise_if_error, unpack


async def call_info(p2p, peer_id: str, timeout: float = 10.0) -> dict:
    stub = BlockRPC.get_stub(p2p, PeerID.from_base58(peer_id))
    response = await stub.rpc_info(pack(), timeout=timeout)
    _, metadata = unpack(response)
    raise_if_error(metadata)
    return metadata


async def call_forward(p2p, peer_id: str, hidden: torch.Tensor, start: int, end: int, timeout: float) -> torch.Tensor:
    stub = BlockRPC.get_stub(p2p, PeerID.from_base58(peer_id))
    try:
        response = await stub.rpc_forward(pack((hidden,), {"start": start, "end": end}), timeout=timeout)
    except Exception as error:
        reason = "did not answer in time" if isinstance(error, asyncio.TimeoutError) else f"failed: {error!r}"
        raise ServerUnavailableError(f"server {peer_id} {reason} (blocks {start}:{end})") from None
    tensors, metadata = unpack(response)
    raise_if_error(metadata)
    return tensors[0]


class InferenceStream:
    """The client's end of one server's inference session: push a step, await its reply."""

    def __init__(self, p2p, peer_id: str, start: int, end: int, timeout: float):
        self.p2p, self.peer_id, self.start, self.end, self.timeout = p2p, peer_id, start, end, timeout
        self.session_id = secrets.token_hex(16)  # what the previous server of the chain pushes steps to
        self._requests: asyncio.Queue = asyncio.Queue()
        self._responses = None

    async def open(self, max_length: int, batch_size: int) -> None:
        stub = BlockRPC.get_stub(self.p2p, PeerID.from_base58(self.peer_id))
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
        raise_if_error(metadata)
        return tensors, metadata

    async def _iterate_requests(self):
        while (request := await self._requests.get()) is not None:
            yield request
