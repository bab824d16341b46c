"""The client's end of the block servers' RPC (swarm/wire.py): info, cache-less forwards, inference streams;
the step channels that carry the steps of all of a client's sessions on one server are step_channel.py's.

A session opens and closes on each server through its own inference stream (InferenceStream), but its steps
go through the client's StepChannel to that server (one per server, shared by every session): steps handed to
it in the same turn of the event loop leave together; steps handed to it while a message is in flight wait,
and leave together as the next message when its reply comes. So N sessions stepping at once cost about one
message per server, not N, and a lone step waits for nothing. A step of many positions (a prompt, a replay)
travels alone, at once, so that it never holds up the short steps queued behind it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Optional

import torch
from hivemind.p2p import PeerID

from swarm.client.step_channel import MULTIPLEX_MAX_POSITIONS, NEXT_STEP_POSITIONS, StepChannels, until_none
from swarm.client.step_replies import MalformedOutputsError
from swarm.protocol import ServerUnavailableError
from swarm.wire import BlockRPC, pack, raise_if_error, unpack

logger = logging.getLogger(__name__)

# a step carrying many positions (a long prompt) may take this much longer per position: a CPU server prefilling
# a 6,600-token prompt chunk by chunk, beside other sessions on a busy machine, runs some 30 positions a second
STEP_SECONDS_PER_TOKEN = 0.05
# closed inference streams still being read to their end (asyncio itself keeps only weak references to tasks)
_DRAINING: set[asyncio.Task] = set()


def checked_outputs(output: torch.Tensor, hidden: torch.Tensor, peer_id: str, blocks: str,
                    finite: bool = False) -> torch.Tensor:
    """`output` if it can be a hop's outputs for `hidden`, else MalformedOutputsError. `finite`: checked already
    (a step channel checks a whole message's outputs at once)."""
    if output.shape != hidden.shape or output.dtype != hidden.dtype:
        raise MalformedOutputsError(
            f"server {peer_id} answered inputs of shape {tuple(hidden.shape)} ({hidden.dtype}) with outputs of "
            f"shape {tuple(output.shape)} ({output.dtype}) ({blocks})")
    if not finite and not torch.isfinite(output).all():
        raise MalformedOutputsError(f"server {peer_id} answered with outputs that are not finite ({blocks})")
    return output


async def call_info(p2p, peer_id: str, timeout: float = 10.0) -> dict:
    stub = BlockRPC.get_stub(p2p, PeerID.from_base58(peer_id))
    response = await stub.rpc_info(pack(), timeout=timeout)
    _, metadata = unpack(response)
    raise_if_error(metadata)
    return metadata


def forward_metadata(start: int, end: int, adapter: Optional[str]) -> dict:
    """A cache-less forward's request: its blocks, and the LoRA adapter they run with (if any)."""
    return {"start": start, "end": end, **({"adapter": adapter} if adapter is not None else {})}


async def call_forward(p2p, peer_id: str, hidden: torch.Tensor, start: int, end: int, timeout: float,
                       adapter: Optional[str] = None) -> torch.Tensor:
    stub = BlockRPC.get_stub(p2p, PeerID.from_base58(peer_id))
    try:
        response = await stub.rpc_forward(pack((hidden,), forward_metadata(start, end, adapter)), timeout=timeout)
    except Exception as error:
        reason = "did not answer in time" if isinstance(error, asyncio.TimeoutError) else f"failed: {error!r}"
        raise ServerUnavailableError(f"server {peer_id} {reason} (blocks {start}:{end})") from None
    return forward_outputs(unpack(response), hidden, peer_id, start, end)


def forward_outputs(answer: tuple[list, dict], hidden: torch.Tensor, peer_id: str, start: int, end: int
                    ) -> torch.Tensor:
    """A cache-less forward's outputs, from the server's decoded answer (unary or streamed): its error raised,
    anything but one tensor of the inputs' shape and dtype, all finite, the server's fault."""
    tensors, metadata = answer
    raise_if_error(metadata)
    if len(tensors) != 1:
        raise MalformedOutputsError(f"server {peer_id} answered with {len(tensors)} tensors (blocks {start}:{end})")
    return checked_outputs(tensors[0], hidden, peer_id, f"blocks {start}:{end}")


class InferenceStream:
    """The client's end of one server's inference session: its stream opens the session and, closed, ends it;
    its steps go through the client's step channel to that server."""

    def __init__(self, p2p, peer_id: str, start: int, end: int, timeout: float, channels: StepChannels):
        self.p2p, self.peer_id, self.start, self.end, self.timeout = p2p, peer_id, start, end, timeout
        self.channels = channels  # the client's step channels, one per server
        self.session_id = secrets.token_hex(16)  # what the previous server of the chain pushes steps to
        self._requests: asyncio.Queue = asyncio.Queue()
        self._responses = None

    async def open(self, max_length: int, batch_size: int, fork: Optional[tuple["InferenceStream", int]] = None,
                   adapter: Optional[str] = None, next_positions: int = NEXT_STEP_POSITIONS) -> None:
        """Open the session (through the LoRA `adapter`, if any); with `fork` (a stream of this server's, a
        length), as a fork of that stream's session sharing the cache of its first `length` positions. Its first
        step may be pushed by the previous server with at most `next_positions` positions."""
        stub = BlockRPC.get_stub(self.p2p, PeerID.from_base58(self.peer_id))
        try:
            self._responses = await asyncio.wait_for(stub.rpc_inference(self._iterate_requests()), self.timeout)
        except Exception as error:
            raise ServerUnavailableError(f"server {self.peer_id} could not be reached: {error!r}") from None
        opening = {"start": self.start, "end": self.end, "max_length": max_length, "batch_size": batch_size,
                   "session_id": self.session_id, "next_positions": next_positions}
        if fork is not None:
            opening["fork"] = {"session_id": fork[0].session_id, "length": fork[1]}
        if adapter is not None:
            opening["adapter"] = adapter
        await self._exchange(pack(metadata=opening), self.timeout)

    async def park(self, timeout: Optional[float] = None) -> None:
        """Tell the server the session is idle, kept for reuse: it may close it to make room."""
        await self._exchange(pack(metadata={"park": True}), timeout or self.timeout)

    async def step(self, hidden: torch.Tensor, position: int, timeout: Optional[float] = None, step_id: int = 0,
                   push_to: Optional["InferenceStream"] = None, next_positions: int = NEXT_STEP_POSITIONS,
                   group: int = 0) -> torch.Tensor:
        """The outputs for these positions; a server silent for `timeout` seconds counts as failed (after a
        timeout the session must not be stepped here again: the server may have run the step, or may yet).
        With `push_to`, the server also pushes the outputs to that stream's server, which starts step `step_id`
        before the client sends it. The server computes a push of the step after this one only if it carries at
        most `next_positions` positions (see swarm/server/sessions.py). `group`: see StepChannel.step."""
        entry = self.step_entry(position, step_id, push_to, next_positions)
        channel = self.channels.get(self.peer_id)
        return await channel.step(hidden, entry, timeout or self.timeout, f"blocks {self.start}:{self.end}", group)

    def step_entry(self, position: int, step_id: int, push_to: Optional["InferenceStream"],
                   next_positions: int) -> dict:
        """A step's line in its message (see step)."""
        entry = {"session_id": self.session_id, "position": position, "step_id": step_id,
                 "next_positions": next_positions}
        if push_to is not None:
            entry["push_to"] = {"peer_id": push_to.peer_id, "session_id": push_to.session_id}
        return entry

    async def flowing_step(self, shape: tuple[int, int], position: int, push_wait: float, timeout: float,
                           step_id: int, push_to: Optional["InferenceStream"] = None,
                           next_positions: int = NEXT_STEP_POSITIONS) -> torch.Tensor:
        """`step` of inputs the client does not send: the previous server of the chain pushes them (a flowing
        step). `shape`: their (rows, length). The server answers once it has computed the pushed step, or with
        NoPushError if no push of it came within `push_wait` seconds (or the client's own copy came first).
        (outputs, what the server says the push carried: swarm/wire.py's inputs_digest)."""
        entry = {"session_id": self.session_id, "position": position, "step_id": step_id,
                 "next_positions": next_positions, "await_push": True, "push_wait": push_wait,
                 "rows": shape[0], "length": shape[1]}
        if push_to is not None:
            entry["push_to"] = {"peer_id": push_to.peer_id, "session_id": push_to.session_id}
        channel = self.channels.get(self.peer_id)
        return await channel.step(None, entry, timeout, f"blocks {self.start}:{self.end}")  # type: ignore

    async def close(self) -> None:
        self._requests.put_nowait(None)  # ends the request stream: the server frees the cache
        if self._responses is not None:  # read to its end in the background: closing never waits on a server
            draining = asyncio.create_task(self._drain())
            _DRAINING.add(draining)
            draining.add_done_callback(_DRAINING.discard)

    async def _drain(self) -> None:
        """Read the stream to its end. hivemind awaits the task that writes our requests only there, so when the
        server is gone that task's failure (a reset connection) is retrieved here, not logged by asyncio as a
        "Task exception was never retrieved" with its traceback."""
        responses, self._responses = self._responses, None
        try:
            async with asyncio.timeout(self.timeout):
                async for _ in responses:
                    pass
        except Exception:  # a server gone, or one that does not end the stream: either way nothing is left to do
            logger.debug("the inference stream to %s ended badly", self.peer_id, exc_info=True)
        finally:
            await responses.aclose()

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

    def _iterate_requests(self):
        return until_none(self._requests)


__all__ = ["MULTIPLEX_MAX_POSITIONS", "MalformedOutputsError", "StepChannels", "InferenceStream", "call_info",
           "call_forward"]
