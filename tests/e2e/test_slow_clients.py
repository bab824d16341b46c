"""Silent and slow clients take no thread of the gateway (gateway/web/slow_clients.py), through the shared `gateway`
(real gunicorn, configured by gunicorn.conf.py; its HTTP_HEADER_TIMEOUT is short: tests/shared_gateways.py).

2,000 sockets send a request line and one header, then nothing, or (1,400 of them) whole headers and a little of the
body they state, then nothing: more than the gateway has threads (1,070 here, 1,320 with the default limits), each
of which gunicorn's own worker gave one for good (a body's, to the end of the body). Meanwhile /health answers (gunicorn's worker
left it unanswered): the worst of several calls, once the gateway has taken in the burst, is printed with -s (about
1 ms; the first call, queued behind the 2,000 connections, 0.3 to 0.5 s), its bound a hang detector on a loaded
2-core machine. Once HTTP_HEADER_TIMEOUT has passed the gateway has closed every silent socket, each with a 408 (one
of them a kept-alive connection that began its next request). Headers past 64 KiB get a 431 at once.
The sockets come from 20 loopback addresses, under each one's HALF_OPEN_PER_ADDRESS; one more address past it (and
past the grace that spares a burst) has its newest connections closed at once, the others kept.
"""

from __future__ import annotations

import http.client
import resource
import selectors
import socket
import time

from config import Limits
from gateway.web.slow_clients import GRACE_OF_THE_TIMEOUT, HALF_OPEN_GRACE, HEADER_BYTES
from shared_gateways import TINY_HEADER_TIMEOUT

SILENT = 2000
ADDRESSES = 20  # 127.0.0.2 ... 127.0.0.21: 100 sockets each, under HALF_OPEN_PER_ADDRESS
PER_ADDRESS = Limits().half_open_per_address
PAST_THE_LIMIT = 10
HEALTH_CALLS = 10
HANG = 1.0  # seconds: a /health slower than this while the sockets are held is a hang (measured: about 1 ms)
PARTIAL_REQUEST = b"GET /health HTTP/1.1\r\nHost: gateway\r\n"  # no blank line: the headers never end
TRICKLING = 1400  # of the SILENT: whole headers, and 10 of the 1,000 bytes of body they state
PARTIAL_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n" + b'{"model": ')


def _raise_open_files(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else min(needed, hard),
                                                    hard))


def _silent_socket(port: int, source: str, sent: bytes = PARTIAL_REQUEST) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
    sock.sendall(sent)
    return sock


def _kept_alive_then_silent(port: int) -> socket.socket:
    """A connection that gets one reply, kept alive, then begins its next request and goes silent."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", "/health")
    reply = connection.getresponse()
    assert reply.status == 200 and reply.getheader("Connection") == "keep-alive"
    reply.read()
    connection.sock.sendall(PARTIAL_REQUEST)
    return connection.sock


def _health_timings(port: int, calls: int = HEALTH_CALLS) -> list[float]:
    timings = []
    for _ in range(calls):
        began = time.monotonic()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG * 5)
        try:
            connection.request("GET", "/health")
            assert connection.getresponse().status == 200
        finally:
            connection.close()
        timings.append(time.monotonic() - began)
    return timings


def _closed_by_the_gateway(sockets: list[socket.socket], within: float) -> list[bytes]:
    """What each socket read before the gateway closed it (b"" where it was closed without a word); a socket still
    open after `within` seconds is left out."""
    replies = {sock: b"" for sock in sockets}
    selector = selectors.DefaultSelector()
    for sock in sockets:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    deadline = time.monotonic() + within
    closed = []
    while len(closed) < len(sockets) and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=1.0):
            try:
                data = key.fileobj.recv(4096)
            except ConnectionResetError:
                data = b""
            replies[key.fileobj] += data
            if not data:
                selector.unregister(key.fileobj)
                closed.append(replies[key.fileobj])
    selector.close()
    return closed


def test_silent_sockets_take_no_thread_and_are_closed_after_the_header_timeout(gateway):
    _raise_open_files(SILENT + PER_ADDRESS + 1024)
    sockets = []
    _health_timings(gateway.port, calls=1)  # its look at the swarm fresh (health.py): what is timed is the sockets'
    try:
        sockets = [_silent_socket(gateway.port, f"127.0.0.{2 + index % ADDRESSES}",
                                  PARTIAL_BODY if index < TRICKLING else PARTIAL_REQUEST) for index in range(SILENT - 1)]
        sockets.append(_kept_alive_then_silent(gateway.port))
        held_at = time.monotonic()
        _health_timings(gateway.port, calls=1)  # answered once the gateway has taken in the burst (its accept queue)
        timings = _health_timings(gateway.port)
        print(f"\n/health while {SILENT} silent sockets are held: worst {max(timings) * 1000:.1f} ms, "
              f"median {sorted(timings)[len(timings) // 2] * 1000:.1f} ms")
        assert max(timings) < HANG
        closed = _closed_by_the_gateway(sockets, within=TINY_HEADER_TIMEOUT + 30)
        assert len(closed) == SILENT  # every one of them, by the gateway
        assert time.monotonic() - held_at >= TINY_HEADER_TIMEOUT - 0.1  # after the last one's time was up
        assert set(closed) == {b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"}
    finally:
        for sock in sockets:
            sock.close()


def test_one_address_past_its_half_open_limit_has_its_newest_connections_closed(gateway):
    _raise_open_files(PER_ADDRESS + PAST_THE_LIMIT + 1024)
    first, past = [], []
    try:
        first = [_silent_socket(gateway.port, "127.0.0.99") for _ in range(PER_ADDRESS)]
        time.sleep(min(HALF_OPEN_GRACE, TINY_HEADER_TIMEOUT * GRACE_OF_THE_TIMEOUT) + 0.1)  # a burst no longer
        past = [_silent_socket(gateway.port, "127.0.0.99") for _ in range(PAST_THE_LIMIT)]
        assert _closed_by_the_gateway(past, within=10) == [b""] * PAST_THE_LIMIT  # at once, without a word
        assert len(_health_timings(gateway.port)) == HEALTH_CALLS  # another address is served meanwhile
        assert _closed_by_the_gateway(first, within=0.1) == []  # the first ones wait on, till their header timeout
        too_large = socket.create_connection(("127.0.0.1", gateway.port), timeout=30)
        past.append(too_large)
        too_large.sendall(PARTIAL_REQUEST + b"X-Padding: " + b"x" * HEADER_BYTES)  # past the limit, still no end
        assert _closed_by_the_gateway([too_large], within=10) == [
            b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"]
    finally:
        for sock in first + past:
            sock.close()
