"""Server-to-server pushes: a step's outputs sent on to the next server of its client's chain as soon as they
are ready, so that it starts before the client's own copy of the same inputs arrives (see
ServerSession.pushed). Only to servers that announce the blocks the step goes on with, as this server's DHT
node finds them (a client names the peer, and could otherwise make the server send its outputs to any peer at
the server's expense), and PUSHES_IN_FLIGHT messages at most on their way: past that, pushes are skipped (they
only save time; the clients send the same inputs).

The slots are shared fairly: one client's pushes (those of the steps of one calling peer) hold at most
PUSHES_PER_CLIENT of them, so that a chain naming a next server that stalls fills that client's slots, not every
other client's. A push waits for its reply a few of the round trips measured to its server (round_trips.py), not
a fixed long while, and a next server that does not answer one of a client's pushes in time (or cannot be reached)
gets none of that client's pushes for STALLED_PAIR_SECONDS.

On the receiving server, a push starts an early step (EarlyStep) of its session, if the session takes it (see
ServerSession.pushed: only what the client's own next step will ask for).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Collection, Optional

import torch
from hivemind.p2p import PeerID

from swarm.protocol import (MAX_ROUND_TRIPS, BadRequestError, NoPushError, ServerUnavailableError, SwarmError,
                            error_from_wire)
from swarm.server import metrics
from swarm.server.batching import Job
from swarm.server.fields import is_int, step_id_field
from swarm.server.latency import NO_LATENCY, SimulatedLatency
from swarm.server.round_trips import PushRoundTrips
from swarm.wire import BlockRPC, pack, stacked, step_shape, unary_payload_bytes, unpack

logger = logging.getLogger(__name__)

PUSH_TIMEOUT = 10.0  # seconds a push waits for its reply, at most (and to a server of no measured round trip)
MIN_PUSH_TIMEOUT, PUSH_TIMEOUT_ROUND_TRIPS = 2.0, 10  # at least, else this many of its measured round trips
PUSH_ENTRY_BYTES = 256  # a push's entry in the message's metadata: a session id, a step id, a position, a shape
PUSHES_IN_FLIGHT = 64  # push messages on their way at once, all clients'
PUSHES_PER_CLIENT = 16  # of them, one client's
STALLED_PAIR_SECONDS, STALLED_PAIRS_KEPT = 30.0, 4096  # a (client, next server) whose push failed: no pushes
WARNED_PEERS_KEPT = 4096  # peers a failed push was logged at WARNING for (then the log starts over)
# how long the servers found under a block are trusted, and how often a peer not among them sends for a new look
TARGETS_TTL, TARGETS_MISS_REFRESH, TARGETS_LOOKUP_TIMEOUT = 60.0, 5.0, 10.0
MAX_PUSH_WAIT = 600.0  # seconds a flowing step may wait for its push (field 'push_wait')


@dataclass
class EarlyStep:
    """A step started from the previous server's push, before the client's own copy of its inputs came."""

    step_id: int
    hidden: torch.Tensor  # what the push carried
    position: int
    result: asyncio.Future  # its outputs, or its error (set once the compute thread is done with it)
    job: Optional[Job] = None  # what the compute thread computes

    def answers(self, hidden: torch.Tensor, metadata: dict) -> bool:
        """Whether it computed these inputs, successfully: then its result is the client's step's result."""
        if not self.result.done() or self.result.cancelled() or self.result.exception() is not None:
            return False
        position = metadata.get("position")
        if not is_int(position) or position != self.position:
            return False
        pushed = self.hidden
        return pushed.dtype == hidden.dtype and pushed.shape == hidden.shape and torch.equal(pushed, hidden)


class PushTargets:
    """The peers that announce a block in the DHT, as this server's node finds them: the only ones pushed to."""

    def __init__(self, node, prefix: str, allowed: Collection[str] = ()):
        self.node, self.prefix, self.allowed = node, prefix, frozenset(allowed)
        self._found: dict[int, tuple[float, set[str]]] = {}  # block -> (when looked up, its servers)
        self._lookup = asyncio.Lock()

    async def announce(self, peer_id: str, block: int) -> bool:
        """Whether `peer_id` announces block `block`; looked up again when stale, or at most every few seconds
        for a peer not found (it may have joined since)."""
        found = self._found.get(block)
        if found is None or _stale(found, peer_id):
            async with self._lookup:
                found = self._found.get(block)
                if found is None or _stale(found, peer_id):
                    found = self._found[block] = (time.monotonic(), await self.servers_of(block))
        return peer_id in found[1]

    async def servers_of(self, block: int) -> set[str]:
        from swarm import dht

        try:
            return await asyncio.wait_for(dht.servers_of_block(self.node, self.prefix, block, self.allowed),
                                          TARGETS_LOOKUP_TIMEOUT)
        except Exception as error:  # the DHT unreachable a moment: no pushes meanwhile (clients send anyway)
            logger.debug("looking up the servers of block %d failed: %r", block, error)
            return set()


def _stale(found: tuple[float, set[str]], peer_id: str) -> bool:
    age = time.monotonic() - found[0]
    return age > TARGETS_TTL or (peer_id not in found[1] and age > TARGETS_MISS_REFRESH)


class Pusher:
    """Sends pushes (one message per next server), counting them in the handler's `counters`."""

    def __init__(self, counters: dict, targets: Optional[PushTargets], latency: SimulatedLatency = NO_LATENCY):
        self.p2p = None  # set once the handler has its libp2p endpoint: pushes go out through it
        self.counters, self.targets = counters, targets  # targets None: nothing is pushed
        self.latency = latency  # --simulated-latency: a push leaves, and its reply comes back, delayed
        self.tasks: set[asyncio.Task] = set()  # references, so that the tasks are not collected while they run
        self._warned_peers: set[str] = set()
        self.message_bytes = unary_payload_bytes()  # what one push message may carry
        self.round_trips = PushRoundTrips()  # to each server pushed to: announced in the server's record
        self._per_client: Counter[str] = Counter()  # each client's push messages on their way
        self._stalled: OrderedDict[tuple[str, str], float] = OrderedDict()  # (client, peer) -> pushes again after

    def push(self, pushes: list[tuple[PeerID, int, dict, torch.Tensor]], client: str = "") -> None:
        """(next server, the block it goes on at, entry, outputs) of each push of the steps of `client` (the
        calling peer), beside the replies to it."""
        by_peer: dict[PeerID, list[tuple[int, dict, torch.Tensor]]] = defaultdict(list)
        for peer, block, entry, output in pushes:
            by_peer[peer].append((block, entry, output))
        for peer, items in by_peer.items():
            refusal = self._no_slot(client, peer)
            if refusal is not None:
                self._skip(peer, len(items), refusal)
                continue
            task = asyncio.ensure_future(self._send(peer, items, client))
            self.tasks.add(task)
            self._per_client[client] += 1
            task.add_done_callback(lambda done, client=client: self._sent(done, client))

    def _no_slot(self, client: str, peer: PeerID) -> Optional[str]:
        """Why a push of `client`'s to `peer` is not sent now (None: it is)."""
        if len(self.tasks) >= PUSHES_IN_FLIGHT:
            return "too many pushes on their way"
        if self._per_client[client] >= PUSHES_PER_CLIENT:
            return "too many of this client's pushes on their way"
        until = self._stalled.get((client, peer.to_base58()))
        if until is not None and time.monotonic() < until:
            return "it did not answer this client's last push in time"
        return None

    def _sent(self, task: asyncio.Task, client: str) -> None:
        self.tasks.discard(task)
        self._per_client[client] -= 1
        if self._per_client[client] <= 0:
            del self._per_client[client]

    def _stall(self, client: str, peer: PeerID) -> None:
        """`peer` failed one of `client`'s pushes: none of that client's go to it for a while."""
        self._stalled.pop((client, peer.to_base58()), None)
        self._stalled[client, peer.to_base58()] = time.monotonic() + STALLED_PAIR_SECONDS
        while len(self._stalled) > STALLED_PAIRS_KEPT:
            self._stalled.popitem(last=False)

    def timeout(self, peer: PeerID) -> float:
        """How long a push to `peer` waits for its reply: a few of the round trips measured to it."""
        round_trip = self.round_trips.median(peer.to_base58())
        if round_trip is None:
            return PUSH_TIMEOUT
        return min(PUSH_TIMEOUT, max(MIN_PUSH_TIMEOUT, PUSH_TIMEOUT_ROUND_TRIPS * round_trip))

    async def _send(self, peer: PeerID, items: list[tuple[int, dict, torch.Tensor]], client: str = "") -> None:
        # looked up once per block (a message's steps mostly go on at the same one), not once per step
        blocks = {block: await self.targets.announce(peer.to_base58(), block) if self.targets is not None else False
                  for block in {block for block, _, _ in items}}
        announced = [(entry, output) for block, entry, output in items if blocks[block]]
        if len(announced) < len(items):
            self._skip(peer, len(items) - len(announced), "it does not announce the next blocks")
        fitting = [(entry, output) for entry, output in announced if _push_bytes(output) <= self.message_bytes]
        if len(fitting) < len(announced):  # a step alone over the cap (a long prompt's): its client sends it
            self._skip(peer, len(announced) - len(fitting), "over the transport's message size")
        for part in _under(fitting, self.message_bytes):
            if not await self._send_one(peer, part):
                self._stall(client, peer)
                return

    async def _send_one(self, peer: PeerID, announced: list[tuple[dict, torch.Tensor]]) -> bool:
        """Send one message of pushes: whether `peer` answered it (taken or refused) in time."""
        entries, outputs = [entry for entry, _ in announced], [output for _, output in announced]
        message = pack(stacked(outputs), {"pushes": entries})
        self.counters["push_messages"] += 1
        self.counters["pushes_sent"] += len(announced)
        try:  # its reply comes once the step is queued there: the round trip is the network's
            response = await self._timed(peer, lambda: BlockRPC.get_stub(self.p2p, peer).rpc_push(
                message, timeout=self.timeout(peer)))
            _, metadata = unpack(response)
        except Exception as error:  # the clients' own copies of the inputs follow anyway
            self._failed(peer, len(announced), "unreachable", repr(error))
            return False
        results = metadata.get("results")
        if not isinstance(results, list):  # the whole message was refused (or the reply is malformed)
            results = [metadata] * len(announced)
        refusals = [error for error in map(_error_of, results) if error is not None]
        if refusals:
            self._failed(peer, len(refusals), "refused", str(refusals[0]))
        return True

    async def ping_next(self, block: int, own_peer_id: str) -> None:
        """Time an rpc_info to each server of `block` (the servers this one pushes to), so that the round trips
        it announces cover them before any session routes through both (routing prices the link by them)."""
        if self.targets is None or self.p2p is None:
            return
        peers = sorted(await self.targets.servers_of(block) - {own_peer_id})[:MAX_ROUND_TRIPS]
        await asyncio.gather(*(self._ping(peer) for peer in peers))

    async def _ping(self, peer_id: str) -> None:
        peer = PeerID.from_base58(peer_id)
        try:  # any reply, a refusal too, took the round trip
            await self._timed(peer, lambda: BlockRPC.get_stub(self.p2p, peer).rpc_info(pack(), timeout=PUSH_TIMEOUT))
        except Exception as error:  # gone, or not answering: nothing measured (pushes to it fail the same way)
            logger.debug("pinging %s failed: %r", peer_id, error)

    async def _timed(self, peer: PeerID, call):
        """`call()`'s reply, its round trip (with --simulated-latency's delays both ways) counted to `peer`."""
        sent = time.monotonic()
        await self.latency.delay()
        response = await call()
        await self.latency.delay()
        self.round_trips.add(peer.to_base58(), time.monotonic() - sent)
        return response

    def _skip(self, peer: PeerID, count: int, reason: str) -> None:
        self.counters["pushes_skipped"] += count
        logger.debug("%d step(s) not pushed to %s: %s", count, peer.to_base58(), reason)

    def _failed(self, peer: PeerID, count: int, reason: str, detail: str) -> None:
        """Count pushes the next server did not take; say so once per server (then only at DEBUG)."""
        metrics.PUSHES_FAILED.labels(reason).inc(count)
        self.counters["pushes_failed"] += count
        name = peer.to_base58()
        first = name not in self._warned_peers
        if len(self._warned_peers) >= WARNED_PEERS_KEPT:
            self._warned_peers.clear()
        self._warned_peers.add(name)
        if first:
            logger.warning("%d step(s) pushed to %s: %s (%s); its next failed pushes are logged at DEBUG",
                           count, name, reason, detail)
        else:
            logger.debug("%d step(s) pushed to %s: %s (%s)", count, name, reason, detail)


def _push_bytes(output: torch.Tensor) -> int:
    return output.numel() * output.element_size() + PUSH_ENTRY_BYTES


def _under(pushes: list[tuple[dict, torch.Tensor]], most: int) -> list[list[tuple[dict, torch.Tensor]]]:
    """The pushes in messages of at most `most` bytes each, in order."""
    messages, size = [], most + 1
    for push in pushes:
        if size + _push_bytes(push[1]) > most:
            messages.append([])
            size = 0
        messages[-1].append(push)
        size += _push_bytes(push[1])
    return messages


async def awaited_push(session, metadata: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A flowing step (field 'await_push'): the client sent no inputs, only the step's id, position and shape;
    its inputs come pushed by the previous server of its chain, which starts the step (ServerSession.pushed).
    Its outputs once computed, or NoPushError where no push of it came within 'push_wait' seconds (or the
    client's own copy of the step came first): the client then sends the inputs itself. (outputs, the inputs
    the push carried)."""
    step_id, wait = step_id_field(metadata), metadata.get("push_wait")
    if type(wait) not in (int, float) or not 0 <= wait <= MAX_PUSH_WAIT:
        raise BadRequestError(f"field 'push_wait' must be a number of seconds in [0, {MAX_PUSH_WAIT:g}], got "
                              f"{wait!r:.80}")
    if session.early_step(step_id) is None and session.push_may_come(step_id) and session.push_arrival is None:
        arrival = session.push_arrival = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait([arrival], timeout=wait)
        finally:
            session.push_arrival = None
            arrival.cancel()
    early = session.early_step(step_id)
    if early is None or early.position != metadata.get("position") or \
            list(early.hidden.shape[:2]) != [metadata.get("rows"), metadata.get("length")]:
        raise NoPushError(f"no push of step {step_id} came within {wait:g} s: send its inputs")
    session.take_early(metadata)  # it is this step's: taken, and the step's declaration counts from now
    await asyncio.wait([early.result])
    if early.result.cancelled():
        raise ServerUnavailableError("this session has ended")
    return early.result.result(), early.hidden  # raises the step's error


def push_of(target: tuple[PeerID, str], block: int, metadata: dict,
            output: torch.Tensor) -> tuple[PeerID, int, dict, torch.Tensor]:
    """(server, the block it goes on at, entry, outputs) of a push: the entry tells the next server its session,
    and which step of it these inputs are."""
    peer, session_id = target
    entry = {"session_id": session_id, "step_id": metadata.get("step_id"), "position": metadata.get("position"),
             **step_shape(output)}
    return peer, block, entry, output


def _error_of(result) -> Optional[SwarmError]:
    return error_from_wire(result) if isinstance(result, dict) else SwarmError("malformed reply")
