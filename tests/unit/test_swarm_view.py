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
