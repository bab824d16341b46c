"""The block server's RPC handlers: decode requests, hand them to the backend, encode replies.

The messages are swarm/wire.py's; what a request may ask is checked by the backend (swarm/server/backend.py).
A client's sessions open one by one (rpc_inference) but step together: one rpc_steps message carries the steps
of all the sessions it has here at that moment, which run concurrently (so that they land in the same compute
round, see batching.py) and are answered by one message. The message is the unit: its steps' hidden states come
stacked in one tensor, checked once, and run as one batch of jobs (swarm/server/step_batch.py); the reply stacks the
outputs likewise. Their outputs go on to the next servers of the clients' chains as one rpc_push message per next
server, whatever the number of sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator, Collection, Optional

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from swarm.protocol import (
    BadRequestError,
    InternalServerError,
    NotAllowedError,
    ServerLimitError,
    SessionClosedError,
    SwarmError,
    error_to_wire,
)
from swarm.server import metrics
from swarm.server.backend import check_rows, typed_steps
from swarm.server.flow import StepFlow, StreamSlots
from swarm.server.latency import NO_LATENCY, SimulatedLatency
from swarm.server.pushes import Pusher, PushTargets, push_of
from swarm.server.fields import is_int
from swarm.server.step_entries import check_flowing_shape, push_target, sent_entries, with_flowing
from swarm.server.timings import timed_message
from swarm.wire import (BlockRPC, check_hidden_sizes, gather_parts, inputs_digest, misshapen_hidden, reply,
                        split_parts, stacked, step_message_bytes, tensor_bytes, unpack, unpack_metadata, unstacked)

logger = logging.getLogger(__name__)

REFUSAL_LINGER = 5.0  # seconds a refused stream stays open for the client to end it
# streamed forwards gathered or computed at once: each holds its whole request and output (up to
# max_request_tokens of hidden states: 134 MB at hidden size 4096); the others wait, holding a few parts each
STREAMED_FORWARDS = 2
STREAMED_FORWARD_TIMEOUT = 120.0  # seconds for one, from its first part to its output (a stalled sender too)
UNPACK_OFF_LOOP_BYTES = 4 << 20  # tensors of a step message past which it is decoded on a thread
STALLED_STREAM_SECONDS = 10.0  # a step stream whose peer has read none of its replies for this long is ended
# what rpc_info adds to the backend's answer: shows how many sessions' steps share a message
COUNTERS = ("step_messages", "steps_received", "push_messages", "pushes_sent", "pushes_failed", "pushes_skipped")
# bytes of a message's metadata: a step's entry (ids, a position, a push target) takes some 250 of them
METADATA_BYTES_PER_STEP, METADATA_BYTES_BASE = 512, 1024
CONTROL_BYTES = 64  # a control message of an inference stream: {"park": true} takes 6


def wire_error(error: BaseException) -> dict:
    """A request's error as it travels: a SwarmError as it is, anything else as an internal error."""
    if not isinstance(error, SwarmError):  # the server's own failure (a failed compute round is counted there)
        metrics.INTERNAL_ERRORS.labels("handler").inc()
        logger.error("request failed", exc_info=error)
        error = InternalServerError("internal server error (see the server's log)")  # details stay in the log
    return error_to_wire(error)


def error_reply(error: Exception, extra: Optional[dict] = None):
    return reply(metadata={**(extra or {}), **wire_error(error)})


class BlockHandler(BlockRPC):
    """Decodes requests, hands them to the server's backend (see swarm/server/backend.py), encodes replies.

    Every request may come from anyone: the backend checks what it carries; here, who sends it (a private
    server takes requests only from `allowed_peers`, if given) and that a peer steps only its own sessions."""

    def __init__(self, backend, allowed_peers: Collection[str] = (), push_targets: Optional[PushTargets] = None,
                 latency: SimulatedLatency = NO_LATENCY):
        self.backend = backend
        self.allowed_peers = frozenset(allowed_peers)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.latency = latency  # --simulated-latency: every message in and out of the handlers is delayed
        self.pusher = Pusher(self.counters, push_targets, latency)  # push_targets None: nothing is pushed
        self._streamed_forwards = asyncio.Semaphore(STREAMED_FORWARDS)
        self.flow = StepFlow.for_sessions(backend.limits.max_sessions_per_peer)

    async def add_p2p_handlers(self, p2p, *args, **kwargs) -> None:
        self.pusher.p2p = p2p
        if self.latency.enabled:
            kwargs["wrapper"] = self.latency.servicer(self)
        await super().add_p2p_handlers(p2p, *args, **kwargs)

    async def rpc_info(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        try:
            self._check_caller(context)
            return reply(metadata={**self.backend.info(), **self.counters,
                                   "step_messages_in_flight": self.flow.in_flight()})
        except Exception as error:
            return error_reply(error)

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        try:
            self._check_caller(context)
            tensors, metadata = unpack(request)
            return reply((await self.backend.forward(tensors, metadata),))
        except Exception as error:
            return error_reply(error)

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """rpc_forward for a sequence too large for one unary message: its tensor comes in parts, and its
        output goes back in parts. A few at a time (each holds a whole request and its output); a request
        declaring more than this server's max_request_tokens of hidden states is refused at its first part."""
        try:
            self._check_caller(context)
            async with self._streamed_forwards, asyncio.timeout(STREAMED_FORWARD_TIMEOUT):
                elements = self.backend.limits.max_request_tokens * self.backend.hidden_size
                request = await gather_parts(requests, elements, elements * 4)  # float32 at most
                if request is None:
                    return
                tensors, metadata = unpack(request)
                parts = split_parts(reply((await self.backend.forward(tensors, metadata),)))
        except Exception as error:
            yield error_reply(error)
            await _linger(requests)
            return
        for part in parts:
            yield part

    async def rpc_push(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """Sessions' steps, pushed by the previous server of their clients' chains: it may name a session only
        by its random id, which the client gave only to that server. Started at once, as one batch, those that
        are what the client's own next step will ask for (ServerSession.pushed); the others are refused."""
        try:
            self._check_caller(context)
            unpack_metadata(request, self._max_metadata_bytes())
            self._check_sizes(request)  # before any tensor is decoded
            tensors, metadata = unpack(request, self._misshapen)
            pushes = metadata.get("pushes")
            if not isinstance(pushes, list) or len(pushes) > self.backend.limits.max_sessions_per_peer:
                raise BadRequestError("field 'pushes' must be a list of maps, one per step")
            steps = typed_steps(tensors, unstacked(tensors, pushes))
            refusals = self.backend.accept_pushes(list(zip(steps, pushes)))
            return reply(metadata={"results": [wire_error(error) if error is not None else {} for error in refusals]})
        except Exception as error:
            return error_reply(error)

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A session's stream: its first message opens the session (a fresh one, or a fork of another: see
        Backend.open_session), and the session lasts as long as the stream (or until the server closes it: idle,
        or to make room). Its steps go through rpc_steps; the stream carries only control messages: {"park":
        true} (see ServerSession.park), answered {"ok": true}."""
        try:
            opening = await anext(requests)
            self._check_caller(context)
            _, metadata = unpack(opening)
            session = await self.backend.open_session(metadata, context.remote_id.to_base58())
        except StopAsyncIteration:
            return
        except Exception as error:
            yield error_reply(error)
            await _linger(requests)
            return
        try:
            yield reply(metadata={"ok": True})
            async for request in _until(session.ended, requests):  # the stream holds the session open
                yield _control(session, request)
        finally:
            session.close()

    async def rpc_steps(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Messages of steps of the caller's sessions; each is answered when all its steps are done, and the
        next ones are read meanwhile (a message of long steps does not hold up a message of short ones), as long
        as the peer has messages in flight to spare (see swarm/server/flow.py): a peer that does not read its
        replies stops being read, and after STALLED_STREAM_SECONDS its stream is refused and read to its end
        unanswered (hivemind sees a hung-up peer only by reading its stream)."""
        peer_id = context.remote_id.to_base58()
        try:
            self._check_caller(context)
        except Exception as error:
            yield error_reply(error)
            await _linger(requests)
            return
        replies: asyncio.Queue = asyncio.Queue()
        slots = self.flow.open_stream(peer_id, end=lambda: reader.cancel())  # a newer stream of the peer's may end it
        reader = asyncio.ensure_future(self._read_step_messages(requests, peer_id, slots, replies))
        try:
            while (item := await replies.get()) is not None:
                response, holds_slot = item
                yield response  # returns once the transport took it: the peer reads, or its buffers have room
                if holds_slot:
                    slots.give_back()
        finally:
            reader.cancel()  # the client hung up: the steps still running stop (their sessions stay open)
            self.flow.close_stream(peer_id, slots)

    async def _read_step_messages(self, requests: AsyncIterator, peer_id: str, slots: StreamSlots,
                                  replies: asyncio.Queue) -> None:
        running: set[asyncio.Task] = set()

        async def answer(request, arrived: float):
            try:
                replies.put_nowait((await self._reply_to_step_message(request, peer_id, arrived), True))
            except Exception as error:  # a bug here must cost one message, never the stream
                replies.put_nowait((error_reply(error), True))

        try:
            async for request in requests:
                arrived = time.perf_counter()
                if not await slots.take(STALLED_STREAM_SECONDS):  # none free: not read on until a reply goes out
                    stalled = ServerLimitError(f"peer {peer_id} read none of its replies for "
                                               f"{STALLED_STREAM_SECONDS:.0f} s: this server ends the step stream")
                    replies.put_nowait((error_reply(stalled), False))
                    await _linger(requests)  # unanswered, until the peer ends its side (it may have hung up)
                    return
                task = asyncio.ensure_future(answer(request, arrived))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.gather(*running)
        finally:
            for task in running:
                task.cancel()
            replies.put_nowait(None)

    async def _reply_to_step_message(self, request, peer_id: str, arrived: Optional[float] = None):
        """One message's steps, run as one batch; the reply (with what the message cost here: timings.py), and
        the outputs pushed on to the next servers. Run in a task of its own (its timings are the task's)."""
        timings = timed_message(arrived if arrived is not None else time.perf_counter())
        message_id = None
        try:
            metadata = unpack_metadata(request, self._max_metadata_bytes())
            message_id = metadata.get("message_id") if is_int(metadata.get("message_id")) else None
            self._check_sizes(request)  # before any tensor is decoded
            tensors, metadata = await self._unpack_steps(request)
            tensors = [_detached(tensor) for tensor in tensors]  # once for the message, not per step
            entries = self._step_entries(metadata)
            steps = with_flowing(entries, typed_steps(tensors, unstacked(tensors, sent_entries(entries))))
        except Exception as error:
            return error_reply(error, {"message_id": message_id})
        self.counters["step_messages"] += 1
        self.counters["steps_received"] += len(entries)
        results, items = self._sessions_of(entries, steps, peer_id)
        timings.mark_decoded()
        outputs = await self.backend.run_steps([(session, step, entry) for _, session, step, entry, _ in items])
        pushes, answers = [], [{} for _ in results]
        for (index, session, _, entry, push_to), output in zip(items, outputs):
            if isinstance(output, tuple):  # a flowing step's: the client checks what its push carried
                output, pushed = output
                answers[index] = {"pushed": inputs_digest(pushed)}
            results[index] = output
            if push_to is not None and not isinstance(output, BaseException):
                pushes.append(push_of(push_to, session.end, entry, output))
        self.pusher.push(pushes, peer_id)
        answers = [wire_error(result) if isinstance(result, BaseException) else answer
                   for result, answer in zip(results, answers)]
        return reply(stacked([result for result in results if not isinstance(result, BaseException)]),
                     lambda: {"message_id": message_id, "results": answers, "timings": timings.wire()})

    def _sessions_of(self, entries: list, steps: list, peer_id: str) -> tuple[list, list]:
        """Each step's refusal where it has one (else None), and (index, session, hidden, entry, push target) of
        the others."""
        refusals, items = [None] * len(entries), []
        for index, (entry, step) in enumerate(zip(entries, steps)):
            try:
                session = self._own_session(entry, peer_id)
                push_to = push_target(entry)  # checked first: a step must not run, then be refused
                if isinstance(step, SwarmError):  # refused undecoded
                    raise step
                if step is None:  # a flowing step: its inputs come pushed (swarm/server/pushes.awaited_push)
                    check_flowing_shape(entry, session.batch_size)
                else:
                    check_rows(step, session.batch_size)
                items.append((index, session, step, entry, push_to))
            except SwarmError as error:
                refusals[index] = error
        return refusals, items

    async def _unpack_steps(self, request) -> tuple[list, dict]:
        """Decoding copies the tensor: a big message is decoded on a thread, not on the loop that serves
        every other peer's steps."""
        if tensor_bytes(request) > UNPACK_OFF_LOOP_BYTES:
            return await asyncio.to_thread(unpack, request, self._misshapen)
        return unpack(request, self._misshapen)

    def _step_entries(self, metadata: dict) -> list:
        entries = metadata.get("steps")
        if not isinstance(entries, list):
            raise BadRequestError("field 'steps' must be a list of maps, one per step")
        if len(entries) > self.backend.limits.max_sessions_per_peer:  # one step per session
            raise BadRequestError(f"a message of {len(entries)} steps is over this server's limit of "
                                  f"{self.backend.limits.max_sessions_per_peer} sessions per peer")
        return entries

    def _own_session(self, entry, peer_id: str):
        if not isinstance(entry, dict) or not isinstance(entry.get("session_id"), str):
            raise BadRequestError("each step must be a map with a 'session_id'")
        session = self.backend.sessions.by_id.get(entry["session_id"])
        if session is None or session.peer_id != peer_id:  # another peer's session reads as no session at all
            raise SessionClosedError("this server holds no session of yours with this 'session_id' (it ended, "
                                     "or the server closed it: idle too long, or to make room)")
        return session

    def _max_metadata_bytes(self) -> int:
        return METADATA_BYTES_BASE + METADATA_BYTES_PER_STEP * self.backend.limits.max_sessions_per_peer

    def _check_sizes(self, request) -> None:
        """A message of steps or pushes carries one tensor of hidden states per session (of the peer's, at most
        its limit of them), no more tokens in all than one request may, and no more bytes than one message of
        steps may (its reply, of the same steps' outputs, would be as big: a client splits a longer step)."""
        limits = self.backend.limits
        check_hidden_sizes(request, limits.max_sessions_per_peer, limits.max_request_tokens, self.backend.hidden_size)
        if tensor_bytes(request) > step_message_bytes():
            raise BadRequestError(f"a message of {tensor_bytes(request)} bytes of hidden states is over the cap of "
                                  f"{step_message_bytes()} bytes per message: split its steps")

    def _misshapen(self, tensor: runtime_pb2.Tensor) -> Optional[SwarmError]:
        return misshapen_hidden(tensor, self.backend.hidden_size)

    def _check_caller(self, context: P2PContext) -> None:
        if self.allowed_peers and context.remote_id.to_base58() not in self.allowed_peers:
            raise NotAllowedError(f"peer {context.remote_id.to_base58()} is not on this server's list of clients")


def _detached(tensor):
    """A request may say requires_grad: nothing here needs a graph."""
    return tensor.detach() if isinstance(tensor, torch.Tensor) and tensor.requires_grad else tensor


def _control(session, request):
    """The reply to a control message of a session's inference stream."""
    try:
        metadata = unpack_metadata(request, CONTROL_BYTES)
        if request.tensors or metadata != {"park": True}:
            raise BadRequestError('an inference stream carries its opening and {"park": true} only: steps go '
                                  'through rpc_steps')
        session.park()
        return reply(metadata={"ok": True})
    except Exception as error:
        return error_reply(error)


async def _until(ended: asyncio.Event, requests: AsyncIterator) -> AsyncIterator:
    """A session's stream of requests, until the client ends it or the server closes the session (idle, or to
    make room): the stream then ends too, and holds nothing on either side."""
    closing, request = asyncio.ensure_future(ended.wait()), None
    try:
        while True:
            request = asyncio.ensure_future(anext(requests))
            await asyncio.wait({request, closing}, return_when=asyncio.FIRST_COMPLETED)
            if not request.done():
                return
            try:
                message = request.result()
            except StopAsyncIteration:
                return
            yield message
    finally:
        for task in (closing, request):
            if task is not None and not task.done():
                task.cancel()


async def _linger(requests: AsyncIterator) -> None:
    """After a refusal, wait for the client to end its side (a bounded time): a stream that the server closes
    at once sometimes loses the reply on its way through the libp2p daemons, and the client waits in vain."""

    async def drain():
        async for _ in requests:
            pass

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(drain(), REFUSAL_LINGER)
