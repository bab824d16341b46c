"""Idle keep-alive connections outlive what clients expect of them (HTTP_KEEPALIVE): Node's undici reuses an idle
connection for 4 s, and gunicorn's own default (2 s) closed it first without a word, so the Vercel AI SDK's next
request after a streamed reply met "other side closed". A client that reuses its connection after 3 s is served,
and every reply says how long the gateway keeps one (Keep-Alive: timeout=N), which undici and browsers honour."""

from __future__ import annotations

import http.client
import json
import time

from config import Limits

IDLE = 3.0  # seconds: past gunicorn's default, within undici's 4 s


def _streamed_reply(connection: http.client.HTTPConnection) -> http.client.HTTPResponse:
    body = json.dumps({"model": "tiny", "input": "Hi", "max_output_tokens": 3, "stream": True})
    connection.request("POST", "/v1/responses", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200, response.read()
    body = response.read()  # to its end: the connection idles (a sampled reply may stop before max_output_tokens)
    assert b"event: response.incomplete" in body or b"event: response.completed" in body, body[-300:]
    return response


def test_a_connection_reused_after_three_idle_seconds_is_served(gateway):
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
    try:
        first = _streamed_reply(connection)
        socket_before = connection.sock
        time.sleep(IDLE)
        _streamed_reply(connection)  # http.client raises RemoteDisconnected where the gateway closed it meanwhile
        assert connection.sock is socket_before  # the same connection, not a new one
        assert first.getheader("Keep-Alive") == f"timeout={int(Limits().http_keepalive)}"
    finally:
        connection.close()
