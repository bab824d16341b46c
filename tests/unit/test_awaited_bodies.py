"""Which bodies the gateway's worker reads on its event loop before a thread takes the request
(gateway/web/slow_clients.py, _body_awaited): one of a stated length within MAX_BODY_BYTES; never a chunked one, one
whose client waits for a 100 Continue, one past the cap (refused with a 413 by the thread), or a malformed length."""

import pytest

from gateway.web.slow_clients import _body_awaited

LINE = b"POST /v1/completions HTTP/1.1\r\nHost: gateway"


@pytest.mark.parametrize("fields, awaited", [
    (b"Content-Length: 1000", 1000),
    (b"content-length:  7 ", 7),
    (b"Content-Length: 0", 0),
    (b"", 0),  # no body
    (b"Transfer-Encoding: chunked", 0),
    (b"Content-Length: 10\r\nExpect: 100-continue", 0),  # curl waits a second for the 100 before it sends
    (b"Content-Length: 2048", 0),  # past the cap: the thread reads what it refuses
    (b"Content-Length: -5", 0),
    (b"Content-Length: 12abc", 0),
    (b"Content-Length: 10\r\nContent-Length: 20", 0),  # two lengths: gunicorn's parser answers it
])
def test_a_body_is_awaited_only_where_its_length_is_stated_and_within_the_cap(fields, awaited):
    headers = LINE + (b"\r\n" + fields if fields else b"")
    assert _body_awaited(headers, most=1024) == awaited
