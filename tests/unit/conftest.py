"""Fixtures the unit tests of the block server's cache share."""

from __future__ import annotations

import threading

import pytest

from swarm.server.cache import KVPool


@pytest.fixture
def takers(monkeypatch) -> list[str]:
    """The name of the thread of every page taken from any pool (copies included): pages are taken only on the
    event loop, never on the compute thread (see swarm/server/cache.py)."""
    names, take_page = [], KVPool.take_page

    def recorded(pool):
        names.append(threading.current_thread().name)
        return take_page(pool)

    monkeypatch.setattr(KVPool, "take_page", recorded)
    return names
