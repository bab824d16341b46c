"""gunicorn's threaded worker, with every request's headers read by the worker's event loop instead of a thread.

gunicorn's own gthread worker hands a new connection to a thread at once: the thread waits up to 5 s for a first
byte, then reads the rest of the headers on a blocking socket with no timeout, so a client that sends a request line
and one header, then nothing, holds a thread for as long as it likes; and connections that sent nothing wait
the keep-alive time (65 s) counted among the worker's connections, past which gunicorn stops accepting. A few
thousand silent sockets from one machine left /health unanswered.

Here a connection is half-open until its request's headers are complete (up to the blank line), and its body too
when the headers state its length (up to MAX_BODY_BYTES, and no "Expect: 100-continue", whose client waits to be
asked): the event loop reads its bytes as they come, without a thread, and hands it to a thread only then, the bytes
already read given to gunicorn's parser. So no thread waits for a request's headers, nor for a body that trickles (a
chunked body, or one past the cap that the gateway refuses with a 413, is still read by the thread). A half-open
connection:

- is closed once `header_timeout` seconds pass without its complete headers and stated body (with a 408 if it sent
  anything), as nginx's client_header_timeout and Node's headersTimeout do; and so is one whose headers outgrow
  HEADER_BYTES (with a 431);
- is not counted among gunicorn's worker_connections (silent sockets never stop the worker accepting), but at most
  MAX_HALF_OPEN of them are kept, the oldest closed to make room for a newcomer;
- counts against its address's `half_open_per_address`: past it, once the oldest of them has waited HALF_OPEN_GRACE
  seconds, that address's new connections are closed at once (a unix socket's peers have no address: only the
  global bound holds there). The grace spares a burst: a client opening a thousand WebSockets at once has many
  connections accepted before it has sent their requests, none of them for long.

A kept-alive connection whose next request begins goes through the same stage. TLS (gunicorn's certfile) and HTTP/2
with prior knowledge are left to gunicorn's own handling: their bytes are no HTTP/1 headers to look for.

It builds on gthread's own parts (TConn, enqueue_req, finish_request, murder_pending), as gunicorn 27.0.1 has them:
requirements.txt pins that version.
"""

from __future__ import annotations

import errno
import selectors
import time
from collections import OrderedDict

from gunicorn import http, util
from gunicorn.http2 import negotiation
from gunicorn.workers.gthread import TConn, ThreadWorker

HEADER_END = b"\r\n\r\n"
# gunicorn's own limits allow 4,094 bytes of request line and 100 fields of 8,190; nginx's default buffers take 32 KiB
HEADER_BYTES = 64 << 10
MAX_HALF_OPEN = 4096  # half-open connections at once, every address together (gunicorn.conf.py adds their files)
READ_BYTES = 16 << 10
HALF_OPEN_GRACE = 2.0  # seconds an address's half-open connections may exceed its limit (see the docstring)...
GRACE_OF_THE_TIMEOUT = 0.25  # ... and at most this share of the header timeout
ACCEPTS_AT_ONCE = 256  # connections accepted per turn of the event loop, which then reads those that sent bytes
REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
HEADERS_TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


class HeaderReadingWorker(ThreadWorker):
    """gthread, its threads given connections whose request headers are complete (see the module's docstring)."""

    header_timeout = 20.0  # set from the limits by gunicorn.conf.py (limits_from), in the master before the fork
    half_open_per_address = 128
    max_body_bytes = 1 << 20

    @classmethod
    def limits_from(cls, limits) -> None:
        """HTTP_HEADER_TIMEOUT, HALF_OPEN_PER_ADDRESS and MAX_BODY_BYTES (config.Limits)."""
        cls.header_timeout, cls.half_open_per_address = limits.http_header_timeout, limits.half_open_per_address
        cls.max_body_bytes = limits.max_body_bytes

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.half_open: OrderedDict[TConn, None] = OrderedDict()  # oldest first: their deadlines in order
        self.half_open_by_address: dict[str, dict[TConn, None]] = {}  # each address's, oldest first

    # ---- where connections come from: a new one, or a kept-alive one whose next request begins

    def accept(self, listener):
        """Every connection waiting to be accepted (ACCEPTS_AT_ONCE at most): gunicorn's one per turn of the event
        loop left a burst of silent sockets ahead of /health's connection in the listener's queue."""
        if self.cfg.is_ssl:
            return super().accept(listener)
        for _ in range(ACCEPTS_AT_ONCE):
            try:
                client, address = listener.accept()
            except OSError as error:
                if error.errno in (errno.EMFILE, errno.ENFILE) and self.half_open:
                    self._close_half_open(next(iter(self.half_open)), REQUEST_TIMEOUT)  # a file for the next one
                elif error.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                    raise
                return
            self._admit(listener, client, address)

    def _admit(self, listener, client, address) -> None:
        """A new connection awaits its headers, unless its address already has too many connections doing so."""
        where = _address_of(address)
        if self._too_many_waiting(where):
            util.close(client)  # the newest is refused, not the others
            return
        conn = TConn(self.cfg, client, address, listener.getsockname())
        if negotiation.prior_knowledge_allowed(self.cfg, address):  # HTTP/2 without TLS: gunicorn sniffs its preface
            self.nr_conns += 1
            return super().enqueue_req(conn)
        conn.address = where
        self._await_headers(conn, b"")

    def _too_many_waiting(self, address) -> bool:
        """Whether an address keeps its limit of connections waiting for their headers, for HALF_OPEN_GRACE already."""
        waiting = self.half_open_by_address.get(address, {})
        if len(waiting) < self.half_open_per_address:
            return False
        grace = min(HALF_OPEN_GRACE, self.header_timeout * GRACE_OF_THE_TIMEOUT)
        return next(iter(waiting)).header_deadline - self.header_timeout + grace <= time.monotonic()

    def on_client_socket_readable(self, conn, client):
        """A kept-alive connection's next request begins: its headers are awaited like a new connection's."""
        self.poller.unregister(client)
        self.keepalived_conns.remove(conn)
        self.nr_conns -= 1
        conn.address = None  # accepted once already: only its deadline and the global bound apply
        self._await_headers(conn, b"")

    def enqueue_req(self, conn):
        """gunicorn's finish_request hands back a connection whose client sent its next request's start along with
        the last body: that start, held by the parser, goes through the header stage too."""
        if self.cfg.is_ssl:
            return super().enqueue_req(conn)
        self.nr_conns -= 1
        conn.address = None
        self._await_headers(conn, conn.parser.unreader.take_buffered())

    # ---- the header stage

    def _await_headers(self, conn, received: bytes) -> None:
        conn.received, conn.searched, conn.ready_at = bytearray(received), 0, None
        conn.header_deadline = time.monotonic() + self.header_timeout
        if self._request_ready(conn):
            return self._hand_to_thread(conn)
        while len(self.half_open) >= MAX_HALF_OPEN:
            self._close_half_open(next(iter(self.half_open)), REQUEST_TIMEOUT)  # the oldest makes room
        self.half_open[conn] = None
        if conn.address is not None:
            self.half_open_by_address.setdefault(conn.address, {})[conn] = None
        conn.sock.setblocking(False)
        self.poller.register(conn.sock, selectors.EVENT_READ, lambda _sock: self._read_headers(conn))

    def _read_headers(self, conn) -> None:
        try:
            data = conn.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset by the client
            return self._close_half_open(conn)
        if not data:  # the client closed it
            return self._close_half_open(conn)
        conn.received += data
        if self._request_ready(conn):
            self._leave_half_open(conn)
            self._hand_to_thread(conn)
        elif conn.ready_at is None and len(conn.received) > HEADER_BYTES:
            self._close_half_open(conn, HEADERS_TOO_LARGE)

    def _request_ready(self, conn) -> bool:
        """Whether it sent its request's headers, and the body they state when one is awaited here."""
        if conn.ready_at is None:
            end = conn.received.find(HEADER_END, conn.searched)
            if end < 0:
                conn.searched = max(len(conn.received) - len(HEADER_END) + 1, 0)
                return False
            conn.ready_at = end + len(HEADER_END) + _body_awaited(bytes(conn.received[:end]), self.max_body_bytes)
        return len(conn.received) >= conn.ready_at

    def _hand_to_thread(self, conn) -> None:
        """The headers are complete: gunicorn's parser starts from the bytes read (a new connection's parser is made
        here, which its init() then keeps), and the thread never waits for them."""
        conn.sock.setblocking(True)
        if conn.parser is None:
            conn.parser = http.get_parser(self.cfg, conn.sock, conn.client)
        conn.parser.unreader.unread(bytes(conn.received))
        conn.received = None
        conn.data_ready = True
        self.nr_conns += 1
        super().enqueue_req(conn)

    def _leave_half_open(self, conn) -> None:
        del self.half_open[conn]
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        if conn.address is not None:
            waiting = self.half_open_by_address[conn.address]
            del waiting[conn]
            if not waiting:
                del self.half_open_by_address[conn.address]

    def _close_half_open(self, conn, reply: bytes = b"") -> None:
        """Close it, with `reply` first if it sent anything (best effort: the socket never blocks here)."""
        self._leave_half_open(conn)
        if reply and conn.received:
            try:
                conn.sock.send(reply)
            except OSError:
                pass
        conn.close()

    def murder_pending(self):
        """Each turn of the event loop (about once a second): half-open connections past their header deadline
        close. gunicorn's own pending connections (a new one that sent nothing in 5 s) never arise here."""
        super().murder_pending()
        now = time.monotonic()
        while self.half_open:
            conn = next(iter(self.half_open))
            if conn.header_deadline > now:
                break
            self._close_half_open(conn, REQUEST_TIMEOUT)


def _body_awaited(headers: bytes, most: int) -> int:
    """The bytes of body to read before a thread takes the request: its Content-Length, unless it is chunked, past
    `most`, malformed (gunicorn's parser answers those), or its client waits for a 100 Continue first."""
    length = 0
    for line in headers.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"transfer-encoding" or (name == b"expect" and value == b"100-continue"):
            return 0
        if name == b"content-length":
            if not value.isdigit() or length:  # not a length, or a second one
                return 0
            length = int(value)
    return length if length <= most else 0


def _address_of(address):
    """The client's IP address (a TCP peer), None for a unix socket's peer (its address is empty)."""
    if isinstance(address, tuple) and address:
        return address[0]
    return None

