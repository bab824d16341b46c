"""The client's step channels: the steps of all of a client's sessions on one server, carried together (see
swarm/client/stubs.py, whose inference streams hand their steps to them, and swarm/wire.py's rpc_steps).

A step handed to an idle channel is sent at once; steps handed to it in the same turn of the event loop leave
together; steps handed to it while a message is in flight wait, and leave together as the next message when its
reply comes. A message's steps travel stacked in one tensor, and their outputs come back likewise.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch
from hivemind.p2p import PeerID

from swarm.client.stage_clock import CLOCK, now
from swarm.client.step_replies import blocks_of, clock_answer, deliver, fail
from swarm.protocol import ServerUnavailableError, SwarmError, error_from_wire
from swarm.wire import BlockRPC, pack, stacked, step_message_bytes, step_shape, unpack


# a step of more positions travels alone (it would hold up the others' reply): a decode step, or 1 + a draft
# being verified (config.MAX_SPECULATIVE_TOKENS), goes with the others
MULTIPLEX_MAX_POSITIONS = 33
# what a session declares, at its opening and in each step, that its next step to a server may carry, unless its
# caller says (RemoteSession.next_positions): a short step, decode or 1 + a draft. A server computes a step pushed
# by the previous server of the chain only up to what was declared (see swarm/server/sessions.py)
NEXT_STEP_POSITIONS = MULTIPLEX_MAX_POSITIONS
# tokens (rows x positions) of short steps in one message: servers refuse a message of more tokens than one
# request may carry (--max-request-tokens, 8,192 by default); the steps past it go in the next message
MULTIPLEX_MAX_TOKENS = 1024
# a step of more values is packed on a thread: copying its tensor (128 MiB for 8,192 tokens of hidden size
# 4,096) would hold up the event loop, which carries every session of the client
PACK_OFF_LOOP_VALUES = 1 << 20
EXPIRY_SLACK = 1.0  # seconds past its steps' timeouts after which a message unanswered counts as lost


async def until_none(requests: asyncio.Queue):
    """A queue's items as a stream of requests, up to a None."""
    while (request := await requests.get()) is not None:
        yield request


class _Together:
    """The outcomes of steps handed over together (StepChannel.step_many): one future, set once all are in."""

    def __init__(self, count: int, future: asyncio.Future):
        self.outcomes: list = [None] * count
        self.left, self.future = count, future

    def settle(self, index: int, outcome) -> None:
        self.outcomes[index] = outcome
        self.left -= 1
        if self.left == 0 and not self.future.done():
            self.future.set_result(self.outcomes)


class _Slot:
    """One step's place among steps handed over together: what a step's result future is to the channel (its
    outcome set once; done once set, or once its caller gave up waiting)."""

    __slots__ = ("together", "index", "settled")

    def __init__(self, together: _Together, index: int):
        self.together, self.index, self.settled = together, index, False

    def done(self) -> bool:
        return self.settled or self.together.future.done()

    def set_result(self, outcome) -> None:
        self.settled = True
        self.together.settle(self.index, outcome)

    set_exception = set_result  # its caller tells outcomes apart by their type


@dataclass
class _Step:
    hidden: Optional[torch.Tensor]  # (batch, positions, hidden); None: a flowing step, whose inputs come pushed
    entry: dict  # its line of the message's steps: {session_id, position, step_id, next_positions, push_to?}
    timeout: float
    blocks: str  # named in errors
    result: "asyncio.Future | _Slot"
    group: int = 0  # its session's group: a message carries one group's steps (see StepChannel.step)
    queued: float = field(default_factory=now)  # when its session handed it over (stage_clock.py: "hop_queue")
    # its rows and length (of its inputs, or as a flowing step's entry declares them), its tokens, and what its
    # inputs weigh in a message (a flowing step's come pushed: nothing): read several times as it is queued and sent
    shape: dict = field(init=False)
    tokens: int = field(init=False)
    bytes: int = field(init=False)

    def __post_init__(self):
        hidden = self.hidden
        if hidden is None:
            self.shape, self.bytes = {"rows": self.entry["rows"], "length": self.entry["length"]}, 0
        else:
            self.shape, self.bytes = step_shape(hidden), hidden.numel() * hidden.element_size()
        self.tokens = self.shape["rows"] * self.shape["length"]


@dataclass
class _Lane:
    """Short steps of one kind (sent, or flowing) that travel together: while its message is in flight, the next
    ones wait for its reply. Flowing steps have a lane of their own: their message waits for pushes, and must
    not hold up the steps sent meanwhile (a lost push's copy among them)."""

    queue: list = field(default_factory=list)  # steps waiting for the lane's message's reply
    batching: bool = False  # the lane's message is in flight
    flush_due: bool = False  # a send of the queued steps is scheduled on the loop


@dataclass
class _Message:
    stream: "_StepStream"
    steps: list[_Step]
    expiry: asyncio.TimerHandle
    lane: Optional[_Lane]  # the lane whose message of short steps it is (while it is in flight, they wait)
    sent: float  # when it left (stage_clock.py: "hop_round_trip")


class _StepStream:
    """One rpc_steps stream to a server: messages queue at once (and go as soon as it is connected); each reply
    goes to the channel."""

    def __init__(self, channel: "StepChannel"):
        self.channel, self.closed = channel, False
        self._requests: asyncio.Queue = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read())

    def send(self, message) -> None:
        self._requests.put_nowait(message)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._requests.put_nowait(None)  # ends the request stream
            self._reader.cancel()  # and hangs up, abandoning what is in flight

    async def _read(self) -> None:
        channel = self.channel
        try:
            stub = BlockRPC.get_stub(channel.p2p, PeerID.from_base58(channel.peer_id))
            responses = await asyncio.wait_for(stub.rpc_steps(self._iterate_requests()), channel.connect_timeout)
            async for response in responses:
                channel.answered(self, response)
            reason = "closed the step stream"
        except asyncio.CancelledError:
            raise  # closed by the channel, which has failed its steps already
        except Exception as error:  # timeouts, a refused connection, any failure of the transport
            reason = f"failed: {error!r}"
        channel.broken(self, reason)

    def _iterate_requests(self):
        return until_none(self._requests)


class StepChannel:
    """The client's multiplexed steps to one server (see the module's docstring). It lives on the client's
    event loop: every method runs there. If its stream fails, or a message stays unanswered past its steps'
    timeouts, the steps in flight fail with ServerUnavailableError (each session then fails over on its own)
    and later steps open a new stream."""

    def __init__(self, p2p, peer_id: str, connect_timeout: float):
        self.p2p, self.peer_id, self.connect_timeout = p2p, peer_id, connect_timeout
        self.messages_sent = self.steps_sent = 0
        self._stream: Optional[_StepStream] = None
        self._lanes = (_Lane(), _Lane())  # short steps sent, and flowing steps
        self._messages: dict[int, _Message] = {}  # in flight, by message id
        self._ids = itertools.count()

    async def step(self, hidden: Optional[torch.Tensor], entry: dict, timeout: float, blocks: str,
                   group: int = 0) -> torch.Tensor:
        """A step's outputs; `hidden` None: a flowing step, whose entry says its rows and length. Steps of another
        `group` than the oldest one queued wait for the next message: sessions in groups (the engine loop's
        pipeline) reach this server one group after the other, so that each server of their chain computes one
        group while the next one computes another. A step over the cap on a message's bytes goes in parts."""
        if hidden is not None and hidden.numel() * hidden.element_size() > step_message_bytes():
            return await self._step_in_parts(hidden, entry, timeout, blocks, group)
        return await self._step_whole(hidden, entry, timeout, blocks, group)

    async def _step_in_parts(self, hidden: torch.Tensor, entry: dict, timeout: float, blocks: str,
                             group: int) -> torch.Tensor:
        """A step over the cap on a message's bytes (a long prompt's, swarm/wire.py's step_message_bytes): its
        positions as steps of the same session, one after the other, each under the cap (a position alone over
        it goes alone, and the server refuses it); the outputs are those of the whole step, as a prompt computed
        in chunks through the session's cache is the same as in one pass. Each part declares the next part's
        length as what its next step may carry (a push of it may be computed early), the last what the step
        declared."""
        per_position = hidden.shape[0] * hidden.shape[2] * hidden.element_size()
        length = max(1, step_message_bytes() // per_position)
        parts = hidden.split(length, dim=1)
        outputs = []
        for index, part in enumerate(parts):
            part_entry = {**entry, "position": entry["position"] + index * length}
            if index + 1 < len(parts):
                part_entry["next_positions"] = parts[index + 1].shape[1]
            outputs.append(await self._step_whole(part, part_entry, timeout, blocks, group))
        return torch.cat(outputs, dim=1)

    async def step_many(self, hiddens: list[torch.Tensor], entries: list[dict], timeouts: list[float], blocks: str,
                        group: int = 0) -> list:
        """Short steps of many sessions (each at most MULTIPLEX_MAX_POSITIONS), handed over at once: each one's
        outputs, or the exception it failed with, in order. They travel as `step`'s do, but cost one future and one
        wake-up of their caller together (swarm/client/convoy.py), not one each."""
        together = _Together(len(hiddens), asyncio.get_running_loop().create_future())
        self._queue_short([_Step(hidden, entry, timeout, blocks, _Slot(together, index), group)
                           for index, (hidden, entry, timeout) in enumerate(zip(hiddens, entries, timeouts))])
        return await together.future

    async def _step_whole(self, hidden: Optional[torch.Tensor], entry: dict, timeout: float, blocks: str,
                          group: int) -> torch.Tensor:
        step = _Step(hidden, entry, timeout, blocks, asyncio.get_running_loop().create_future(), group)
        if step.shape["length"] > MULTIPLEX_MAX_POSITIONS:
            message_id = next(self._ids)
            if hidden is not None and hidden.numel() > PACK_OFF_LOOP_VALUES:
                message = await asyncio.to_thread(_pack, [step], message_id)
            else:
                message = _pack([step], message_id)
            self._send([step], lane=None, message_id=message_id, message=message)
        else:
            self._queue_short([step])
        # no timer of its own, which would cost more than the step: its message's expiry fails it, and a step still
        # queued when the message before it expires is dropped if its own timeout has passed (_send_queued)
        return await step.result

    def _queue_short(self, steps: list[_Step]) -> None:
        """Short steps (all sent, or all flowing) into their lane: they leave once the loop has run what is ready
        now, so that the steps that sessions hand over in the same turn of the loop (all the steps an engine tick
        starts, or that one reply resumes) leave together."""
        lane = self._lanes[steps[0].hidden is None]
        lane.queue.extend(steps)
        if not lane.batching and not lane.flush_due:
            lane.flush_due = True
            asyncio.get_running_loop().call_soon(self._flush, lane)

    def answered(self, stream: _StepStream, response) -> None:
        """A reply came: its steps' results, then the steps that waited for it go."""
        try:
            tensors, metadata = unpack(response)
        except SwarmError as error:
            return self.broken(stream, f"sent an undecodable reply ({error})")
        message_id = metadata.get("message_id")
        message = self._messages.get(message_id) if isinstance(message_id, int) else None
        if message is None or message.stream is not stream:
            refusal = error_from_wire(metadata)
            if refusal is not None and message_id is None:  # the whole stream was refused
                self.broken(stream, f"refused the step stream: {refusal}", type(refusal))
            return  # else a late reply to a message given up on
        self._forget(message_id)
        clock_answer(message.sent, message.steps, metadata)
        deliver(message.steps, tensors, metadata, self.peer_id)
        if message.lane is not None:
            message.lane.batching = False
            self._send_queued(message.lane)

    def broken(self, stream: _StepStream, reason: str, error_type: type = ServerUnavailableError) -> None:
        """Fail every step in flight on `stream`; the steps that come later go on a new one."""
        if stream is self._stream:
            self._stream = None
        stream.close()
        for message_id, message in list(self._messages.items()):
            if message.stream is stream:
                self._forget(message_id)
                for step in message.steps:
                    fail(step, error_type(f"server {self.peer_id} {reason} ({step.blocks})"))
                if message.lane is not None:
                    message.lane.batching = False
        for lane in self._lanes:
            if not lane.batching:
                self._send_queued(lane)

    def close(self) -> None:
        if self._stream is not None:
            self.broken(self._stream, "is no longer used: the client closed")
        for lane in self._lanes:
            for step in lane.queue:
                fail(step, ServerUnavailableError("the client closed"))
            lane.queue = []

    def _flush(self, lane: _Lane) -> None:
        lane.flush_due = False
        if not lane.batching:
            self._send_queued(lane)

    def _send_queued(self, lane: _Lane) -> None:
        waiting, sending = [], now()
        for step in lane.queue:
            if sending - step.queued > step.timeout:
                fail(step, ServerUnavailableError(f"server {self.peer_id} did not answer in time ({step.blocks})"))
            elif not step.result.done():  # else its session gave up waiting
                waiting.append(step)
        taken, left, tokens, size, cap = [], [], 0, 0, step_message_bytes()
        for step in waiting:  # the oldest always goes, and the steps of its group that fit beside it
            if taken and (step.group != taken[0].group or tokens + step.tokens > MULTIPLEX_MAX_TOKENS
                          or size + step.bytes > cap):
                left.append(step)
            else:
                taken.append(step)
                tokens, size = tokens + step.tokens, size + step.bytes
        lane.queue = left
        if taken:
            self._send(taken, lane=lane)

    def _send(self, steps: list[_Step], lane: Optional[_Lane], message_id: Optional[int] = None,
              message=None) -> None:
        """Send these steps as one message (`message`, if packed already with `message_id`)."""
        if self._stream is None:
            self._stream = _StepStream(self)
        if message_id is None:
            message_id = next(self._ids)
            message = _pack(steps, message_id)
        self._stream.send(message)
        deadline = max(step.timeout for step in steps) + EXPIRY_SLACK
        expiry = asyncio.get_running_loop().call_later(deadline, self._expired, message_id)
        sent = now()
        self._messages[message_id] = _Message(self._stream, steps, expiry, lane, sent)
        waited = sum(sent - step.queued for step in steps) / len(steps)
        CLOCK.add("hop_queue", waited, len(steps), blocks_of(steps[0]))
        if lane is not None:
            lane.batching = True
        self.messages_sent += 1
        self.steps_sent += len(steps)

    def _expired(self, message_id: int) -> None:
        message = self._messages.get(message_id)
        if message is not None:  # the server is stalled, or the stream lost: nothing more will come on it
            self.broken(message.stream, "did not answer in time")

    def _forget(self, message_id: int) -> None:
        self._messages.pop(message_id).expiry.cancel()


class StepChannels:
    """A client's step channels, one per server, made on first use (on the client's event loop)."""

    def __init__(self, p2p, connect_timeout: float):
        self.p2p, self.connect_timeout = p2p, connect_timeout
        self._channels: dict[str, StepChannel] = {}

    def get(self, peer_id: str) -> StepChannel:
        if peer_id not in self._channels:
            self._channels[peer_id] = StepChannel(self.p2p, peer_id, self.connect_timeout)
        return self._channels[peer_id]

    async def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


def _pack(steps: list[_Step], message_id: int):
    """The steps as one message: their hidden states stacked in one tensor (swarm/wire.py)."""
    entries = [{**step.entry, **step.shape} for step in steps]
    sent = [step.hidden for step in steps if step.hidden is not None]  # flowing steps' inputs come pushed
    return pack(stacked(sent), {"message_id": message_id, "steps": entries})


