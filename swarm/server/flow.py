"""Back-pressure on what peers send the block server: how many step messages one peer may have read and not yet
answered, and how many step streams it may hold open.

A message of steps is read from its stream only once the peer has a free slot, and keeps it until its reply
has been handed to the transport: a peer that sends and never reads its replies stops being read, and the
libp2p stream's own flow control holds the rest on its side, instead of the server queueing replies without
bound. A stream left so for long is ended (see BlockHandler.rpc_steps): hivemind sees that a peer hung up
only by reading its stream, so one never read again would hold its slots for good. An honest client never waits here: it has at most one step of each of its sessions in flight (see
swarm/client/stubs.py), and a peer's sessions are bounded by --max-sessions-per-peer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from swarm.protocol import ServerLimitError

# rpc_steps streams one peer may hold open at once: a client keeps one per server, and for a moment two when it
# replaces a broken one while the server has not yet seen the old one end
STREAMS_PER_PEER = 4
# messages in flight past one per session: stale ones of a client's steps that timed out, still being answered
SLACK_MESSAGES = 8


@dataclass
class _PeerFlow:
    slots: asyncio.Semaphore
    streams: int = 0
    in_flight: int = 0  # messages read and not yet answered, over the peer's streams


@dataclass
class StreamSlots:
    """One step stream's share of its peer's slots: what it holds, given back all at once when it ends."""

    peer: _PeerFlow
    held: int = field(default=0)

    async def take(self, timeout: float) -> bool:
        """A slot for one more message; False if none freed up within `timeout` seconds."""
        try:
            await asyncio.wait_for(self.peer.slots.acquire(), timeout)
        except asyncio.TimeoutError:
            return False
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

    def open_stream(self, peer_id: str) -> StreamSlots:
        """Slots for a new stream of `peer_id`; ServerLimitError past STREAMS_PER_PEER of them."""
        peer = self._peers.get(peer_id)
        if peer is None:
            peer = self._peers[peer_id] = _PeerFlow(asyncio.Semaphore(self.messages_per_peer))
        if peer.streams >= STREAMS_PER_PEER:
            raise ServerLimitError(f"peer {peer_id} has {peer.streams} step streams open on this server already, "
                                   f"its limit per peer (a client needs one)")
        peer.streams += 1
        return StreamSlots(peer)

    def close_stream(self, peer_id: str, stream: StreamSlots) -> None:
        stream.give_all_back()
        stream.peer.streams -= 1
        if stream.peer.streams == 0 and self._peers.get(peer_id) is stream.peer:
            del self._peers[peer_id]

    def in_flight(self) -> int:
        """Messages read and not yet answered onto the transport, over every peer."""
        return sum(peer.in_flight for peer in self._peers.values())

