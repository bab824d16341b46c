"""The caps on open WebSockets (limits.WebSocketSlots), and the threads they size (config.Limits.worker_threads)."""

from __future__ import annotations

import pytest

from config import Limits
from gateway.errors import TooManyWebSockets
from gateway.web.limits import WebSocketSlots


def test_one_client_is_capped_and_others_are_not():
    slots = WebSocketSlots(most=10, per_client=2)
    slots.take("ip:a"), slots.take("ip:a")
    with pytest.raises(TooManyWebSockets, match="MAX_WEBSOCKETS_PER_CLIENT") as refused:
        slots.take("ip:a")
    assert refused.value.status == 429 and refused.value.retry_after == 1
    slots.take("ip:b")
    slots.give_back("ip:a")
    slots.take("ip:a")  # a closed one frees its place
    assert len(slots) == 3


def test_the_gateway_is_capped_whoever_asks():
    slots = WebSocketSlots(most=3, per_client=0)  # 0: no cap of a client's own
    for client in ("ip:a", "ip:a", "ip:b"):
        slots.take(client)
    with pytest.raises(TooManyWebSockets, match="MAX_WEBSOCKETS\\)"):
        slots.take("ip:c")
    for client in ("ip:a", "ip:a", "ip:b"):
        slots.give_back(client)
    assert len(slots) == 0


def test_threads_cover_every_websocket_and_session_with_room_for_the_rest():
    limits = Limits(max_websockets=100, max_sessions=20, http_threads=8)
    assert limits.worker_threads == 128
    assert Limits.from_env({"MAX_WEBSOCKETS": "5", "MAX_WEBSOCKETS_PER_CLIENT": "2", "HTTP_THREADS": "3"}) == \
        Limits(max_websockets=5, max_websockets_per_client=2, http_threads=3)
