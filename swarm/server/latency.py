"""Simulated network latency (--simulated-latency): a swarm on one machine that behaves like one spread over
homes and data centres, for tests and benchmarks.

Every message the server receives is delayed by half the round trip, and every message it sends by the other
half, plus a seeded uniform draw in [0, jitter / 2] each way. The delay is a network's, not a queue's: each
message is held for its own delay from the moment it arrived (or was sent), so that many messages in flight
overlap and N pipelined steps cost about one round trip, not N. On a stream the messages keep their order (a
message never overtakes the one before it, whatever their draws): a stream is one TCP connection.

It wraps the handlers as registered with libp2p (SimulatedLatency.servicer), so that every RPC is covered,
and the server's own outgoing pushes (swarm/server/pushes.py) wait through `delay` both ways. A network map
(swarm/network_map.py, swarm/server/links.py) gives each caller's exchanges the delays of its own link instead.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import AsyncIterator, Callable

# messages of a stream held in flight at once; past it, the sender waits (a network's window): bounds the
# memory a peer's stream can take while its messages are held
MESSAGES_IN_FLIGHT = 256
_END = object()


class SimulatedLatency:
    """`round_trip_ms` added to every exchange with this server; `jitter_ms`: the most added on top, drawn
    uniformly per message from a generator seeded with `seed` (the same seed, the same draws)."""

    def __init__(self, round_trip_ms: float = 0.0, jitter_ms: float = 0.0, seed: int = 0):
        if not (round_trip_ms >= 0 and jitter_ms >= 0):  # NaN fails too
            raise ValueError(f"latencies must not be negative, got {round_trip_ms} ms and {jitter_ms} ms")
        self.round_trip_ms, self.jitter_ms, self.seed = round_trip_ms, jitter_ms, seed
        self._random = random.Random(seed)

    @property
    def enabled(self) -> bool:
        return self.round_trip_ms > 0 or self.jitter_ms > 0

    def describe(self) -> str:
        """For the start-up line."""
        jitter = f" + up to {self.jitter_ms:g} ms jitter (seed {self.seed})" if self.jitter_ms else ""
        return f"simulated latency {self.round_trip_ms:g} ms per round trip{jitter}"

    def one_way(self) -> float:
        """Seconds one message is held."""
        return (self.round_trip_ms + self._random.uniform(0.0, self.jitter_ms)) / 2000.0

    async def delay(self) -> None:
        """One unary message's way (a request arriving, a reply leaving, a push in either direction)."""
        if self.enabled:
            await asyncio.sleep(self.one_way())

    def bind(self, node) -> None:
        """The server's DHT node, once up (a network map reads its callers' regions there)."""

    async def announce(self, node, expiration: float) -> None:
        """Announce what others need to know of this server's network (a network map's region: nothing here)."""

    async def link(self, context) -> "SimulatedLatency":
        """What delays the messages of one exchange, by its caller (`context.remote_id`): here every caller's
        link is the same (a network map's differ: swarm/server/links.py). Anything with `one_way()`."""
        return self

    def wrap(self, method: Callable, stream_input: bool, stream_output: bool) -> Callable:
        """A handler method with every message it receives and sends delayed."""
        if not stream_input and not stream_output:
            async def unary(request, context):
                arrived = time.monotonic()
                link = await self.link(context)
                await _until(arrived + link.one_way())  # a look-up of the caller's region is part of the delay
                response = await method(request, context)
                await asyncio.sleep(link.one_way())
                return response

            return unary

        async def streaming(requests, context):
            arrived = time.monotonic()
            link = await self.link(context)
            incoming = _Delayed(link, requests) if stream_input else None
            try:
                if incoming is None:
                    await _until(arrived + link.one_way())
                output = method(requests if incoming is None else incoming, context)
                if not stream_output:
                    response = await output
                    await asyncio.sleep(link.one_way())
                    yield response
                    return
                outgoing = _Delayed(link, output, close_source=True)
                try:
                    async for response in outgoing:
                        yield response
                finally:
                    await outgoing.aclose()  # the handler's own clean-up (its finally) runs now
            finally:
                if incoming is not None:
                    await incoming.aclose()

        return streaming

    def servicer(self, handler) -> object:
        """What libp2p serves instead of `handler` (hivemind's add_p2p_handlers(wrapper=...)): its rpc_*
        methods, delayed."""
        handler._collect_rpc_handlers()
        delayed = _DelayedServicer()
        for rpc in type(handler)._rpc_handlers:
            setattr(delayed, rpc.method_name,
                    self.wrap(getattr(handler, rpc.method_name), rpc.stream_input, rpc.stream_output))
        return delayed


class _Delayed:
    """A stream's messages as they come out of the network: each one `one_way()` after it went in, in order.

    A pump reads the source ahead (as a socket's buffer would), stamping each message with when it is due;
    aclose stops it (and closes the source, with `close_source`: a handler's generator, whose own clean-up
    must run then). A class, not a generator: the handler's reader task may still be waiting in it when the
    stream is torn down from another task."""

    def __init__(self, link, source: AsyncIterator, close_source: bool = False):
        self.link, self.source, self.close_source = link, source, close_source  # link: what has one_way()
        self._held: asyncio.Queue = asyncio.Queue(MESSAGES_IN_FLIGHT)
        self._pump = asyncio.ensure_future(self._read_ahead())
        self._ended = False

    def __aiter__(self) -> "_Delayed":
        return self

    async def __anext__(self):
        if self._ended:
            raise StopAsyncIteration
        due, message = await self._held.get()
        wait = due - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        if message is _END:
            self._ended = True
            raise StopAsyncIteration
        if isinstance(message, _Failure):
            self._ended = True
            raise message.error
        return message

    async def _read_ahead(self) -> None:
        last_due = 0.0
        try:
            async for message in self.source:
                last_due = max(last_due, time.monotonic() + self.link.one_way())  # never overtakes the last
                await self._held.put((last_due, message))
            await self._held.put((last_due, _END))
        except Exception as error:  # the stream broke: told after the messages before it, as a network would
            await self._held.put((max(last_due, time.monotonic()), _Failure(error)))

    async def aclose(self) -> None:
        self._pump.cancel()
        await asyncio.wait([self._pump])  # its failure, if any, was handed on already
        while not self._held.empty():  # whoever still waits for a message is told the stream ended
            self._held.get_nowait()
        self._held.put_nowait((0.0, _END))
        if self.close_source and hasattr(self.source, "aclose"):
            await self.source.aclose()


async def _until(due: float) -> None:
    wait = due - time.monotonic()
    if wait > 0:
        await asyncio.sleep(wait)


class _DelayedServicer:
    """Holds a handler's delayed rpc_* methods."""


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


NO_LATENCY = SimulatedLatency()
