"""Back-pressure on what peers send the block server: how many step messages one peer may have read and not yet
answered, and how many step streams it may hold open.

A message of steps read from its stream takes one of its peer's slots, and keeps it until its reply has been
handed to the transport; with none free, the stream is not read further. So a peer that sends and never reads
its replies stops being read, and the libp2p stream's own flow control holds the rest on its side, instead of
the server queueing replies without bound. A stream left so for long is ended (see BlockHandler.rpc_steps):
hivemind sees that a peer hung up only by reading its stream. An honest client never waits here: it has at
most one step of each of its sessions in flight (see swarm/client/stubs.py), and a peer's sessions are bounded
by --max-sessions-per-peer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable


# rpc_steps streams one peer may hold open at once: a client keeps one per server, and a moment more when it
# replaces a broken one. A new stream past them ends the peer's oldest: libp2p does not always tell the server
# that a peer hung up, and a peer's newest stream is the one it uses.
STREAMS_PER_PEER = 4
# messages in flight past one per session: stale ones of a client's steps that timed out, still being answered
SLACK_MESSAGES = 8


@dataclass
class _PeerFlow:
    slots: asyncio.Semaphore
    streams: list = field(default_factory=list)  # its StreamSlots, oldest first
    in_flight: int = 0  # messages read and not yet answered, over the peer's streams


@dataclass(eq=False)
class StreamSlots:
    """One step stream's share of its peer's slots: a slot is taken for each message read (none free: the
    stream is not read further) and given back once its reply went out; all at once when the stream ends."""

    peer: _PeerFlow
    end: Callable[[], None]  # ends the stream (its peer opened too many)
    held: int = field(default=0)  # messages read and not yet answered

    async def take(self, timeout: float) -> bool:
        """A slot for one more message; False if none freed up within `timeout` seconds."""
        slots = self.peer.slots
        if slots.locked():  # none free: wait (wait_for makes a task of its own: only when it must wait)
            try:
                await asyncio.wait_for(slots.acquire(), timeout)
            except asyncio.TimeoutError:
                return False
        else:
            await slots.acquire()  # returns at once
        self.held += 1
        self.peer.in_flight += 1
        return True

    def give_back(self) -> None:
        self.held -= 1
        self.peer.in_flight -= 1
        self.peer.slots.release()

    def give_all_back(self) -> None:
        while self.held:
            self.give_back()


class StepFlow:
    """Every peer's step streams and their slots (on the server's event loop)."""

    def __init__(self, messages_per_peer: int):
        self.messages_per_peer = messages_per_peer
        self._peers: dict[str, _PeerFlow] = {}

    @classmethod
    def for_sessions(cls, max_sessions_per_peer: int) -> "StepFlow":
        return cls(max_sessions_per_peer + SLACK_MESSAGES)

    def open_stream(self, peer_id: str, end: Callable[[], None]) -> StreamSlots:
        """Slots for a new stream of `peer_id`, which `end` ends; past STREAMS_PER_PEER, the oldest one ends."""
        peer = self._peers.get(peer_id)
        if peer is None:
            peer = self._peers[peer_id] = _PeerFlow(asyncio.Semaphore(self.messages_per_peer))
        while len(peer.streams) >= STREAMS_PER_PEER:
            oldest = peer.streams[0]
            self.close_stream(peer_id, oldest)
            oldest.end()
        stream = StreamSlots(peer, end)
        peer.streams.append(stream)
        return stream

    def close_stream(self, peer_id: str, stream: StreamSlots) -> None:
        """The stream's slots back to its peer (once: a stream ended early is closed again when it ends)."""
        if stream not in stream.peer.streams:
            return
        stream.give_all_back()
        stream.peer.streams.remove(stream)
        if not stream.peer.streams and self._peers.get(peer_id) is stream.peer:
            del self._peers[peer_id]

    def in_flight(self) -> int:
        """Messages read and not yet answered onto the transport, over every peer."""
        return sum(peer.in_flight for peer in self._peers.values())

