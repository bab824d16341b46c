"""SwarmView (swarm/client/swarm_view.py): one lookup shared by concurrent callers, reused within the age a caller
accepts, refreshed in the background while used, records leaving it when they expire; a fake lookup stands in for
the DHT."""

import asyncio
import threading
import time

from swarm import dht
from swarm.client.swarm_view import SwarmView
from swarm.protocol import RemoteServer, ServerInfo, ServerState


class Lookups:
    """A fake DHT lookup: counts calls, takes `seconds`, returns `servers`."""

    def __init__(self, seconds: float = 0.0):
        self.calls, self.seconds = [], seconds
        self.servers = [RemoteServer("a", ServerInfo(ServerState.ONLINE, 0, 4, 10.0, 64), time.time() + 60)]

    async def fetch(self, prefix, num_blocks, allowed):
        self.calls.append((prefix, num_blocks, allowed))
        await asyncio.sleep(self.seconds)
        return list(self.servers)


def test_callers_share_one_lookup_within_the_age_they_accept():
    lookups = Lookups()
    view = SwarmView(dht.EventLoop.get(), lookups.fetch, refresh_seconds=3600)
    try:
        assert view.servers("m", 4) == lookups.servers
        assert view.servers("m", 4, max_age=30) == lookups.servers
        assert len(lookups.calls) == 1
        view.servers("m", 4, max_age=0)  # a caller that wants it now
        view.servers("m", 4, allowed=frozenset({"a"}))  # another set of allowed servers: a view of its own
        assert lookups.calls[1:] == [("m", 4, frozenset()), ("m", 4, frozenset({"a"}))]
    finally:
        view.close()


def test_concurrent_callers_wait_for_the_one_lookup_in_flight():
    lookups = Lookups(seconds=0.2)
    view = SwarmView(dht.EventLoop.get(), lookups.fetch, refresh_seconds=3600)
    found = []
    threads = [threading.Thread(target=lambda: found.append(view.servers("m", 4, max_age=0))) for _ in range(5)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(5)
        assert len(found) == 5 and len(lookups.calls) == 1
    finally:
        view.close()


def test_a_record_leaves_the_view_when_it_expires_and_the_view_refreshes_while_used():
    lookups = Lookups()
    lookups.servers.append(RemoteServer("b", ServerInfo(ServerState.ONLINE, 0, 4, 10.0, 64), time.time() + 0.3))
    view = SwarmView(dht.EventLoop.get(), lookups.fetch, refresh_seconds=0.1, idle_seconds=0.5)
    try:
        assert {server.peer_id for server in view.servers("m", 4, max_age=60)} == {"a", "b"}
        time.sleep(0.4)
        assert {server.peer_id for server in view.servers("m", 4, max_age=60)} == {"a"}  # no lookup needed
        assert len(lookups.calls) >= 2  # the background kept looking up while the model was used
        time.sleep(1.0)  # unused for longer than idle_seconds: dropped, and no more lookups
        settled = len(lookups.calls)
        time.sleep(0.3)
        assert len(lookups.calls) == settled
    finally:
        view.close()


def test_a_view_of_more_servers_is_refreshed_less_often_and_openings_accept_it_as_old_as_that():
    """A lookup's bytes grow with the servers it brings back: a view is refreshed every second up to 100 servers,
    a second more per 100, at most every announce period; an opening takes the view within its period and a
    margin (a view in use is always that fresh: openings never wait for a lookup)."""
    from swarm.client.swarm_view import MOST_REFRESH_SECONDS, _ModelView

    def period(servers: int) -> float:
        return _ModelView(servers=[None] * servers).period(least=1.0)

    assert (period(15), period(100), period(500), period(1000), period(10000)) == (1.0, 1.0, 5.0, 10.0,
                                                                                   MOST_REFRESH_SECONDS)
    lookups = Lookups()
    lookups.servers = [RemoteServer(f"s{index}", ServerInfo(ServerState.ONLINE, 0, 4, 10.0, 64), time.time() + 60)
                       for index in range(30)]
    view = SwarmView(dht.EventLoop.get(), lookups.fetch, refresh_seconds=0.01)  # 30 servers: every 0.3 s
    try:
        view.servers("m", 4, max_age=0)
        began = time.monotonic()
        while time.monotonic() - began < 1.0:
            view.servers("m", 4)  # an opening's: within the period and OPENING_MARGIN, never a lookup of its own
            time.sleep(0.01)
        # 1 + about 3 in the background, not 100 at the 0.01 s tick; and none of the openings' own: each accepted
        # the view within its period and OPENING_MARGIN
        assert 2 <= len(lookups.calls) <= 6
    finally:
        view.close()
