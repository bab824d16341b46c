"""A block server's defaults for an open swarm, on real server processes of the tiny swarm: a session idle for
--session-idle-timeout is closed and its cache freed (its client fails over on its next step and goes on
right); one peer cannot hold more than --max-cache-share-per-peer of a server's cache while another peer uses
the server: past it, it is refused, and a peer that came first and holds it all loses idle sessions to a
newcomer."""

import pytest
import torch

from shared_swarm import TINY_BLOCKS
from leak_checks import free_cache, wait_for_free_cache
from swarm.client import SwarmClient
from swarm.client.remote_model import RemoteModel
from swarm.protocol import PAGE_TOKENS, CacheFullError

IDLE_SECONDS = 5
CACHE_TOKENS = 32 * PAGE_TOKENS
SHARE_LIMIT = CACHE_TOKENS // 2  # --max-cache-share-per-peer 0.5 (the default, said here all the same)
SHARED = ["--cache-tokens", str(CACHE_TOKENS), "--max-cache-share-per-peer", "0.5", "--max-session-tokens", "64",
          "--cache-wait", "0.5"]


@pytest.fixture(scope="module")
def clients(tiny_swarm):
    """Two peers: each SwarmClient is a peer of its own."""
    made = [SwarmClient(tiny_swarm.initial_peers) for _ in range(2)]
    assert made[0].node.peer_id != made[1].node.peer_id
    yield made
    for client in made:
        client.shutdown()


def open_sessions(client, prefix: str, count: int) -> list:
    return [client.open_session(prefix, TINY_BLOCKS, "the open swarm test's model", PAGE_TOKENS) for _ in range(count)]


def test_an_idle_session_is_closed_and_its_client_fails_over(tiny_swarm, tiny_llama, settings):
    from swarm.client import metrics

    server = tiny_swarm.add_server(["--blocks", f"0:{TINY_BLOCKS}", "--dht-prefix", "idle", "--cache-tokens",
                                    str(CACHE_TOKENS), "--session-idle-timeout", str(IDLE_SECONDS)])
    model = RemoteModel.from_pretrained(str(tiny_llama), tiny_swarm.initial_peers, settings.cache_dir, "idle")
    try:
        prompt, tokens = [[5, 17, 42, 99, 7]], [[3], [11]]
        with model.session(max_length=64) as fresh:  # what the steps give without a pause
            expected = [fresh.step(prompt), *(fresh.step(token) for token in tokens)]
        with model.session(max_length=64) as session:
            first = session.step(prompt)
            wait_for_free_cache(model.client, server, CACHE_TOKENS)  # closed by the server, its page back
            assert "(idle), freeing 16 cache tokens" in server.log_path.read_text()
            failovers = metrics.FAILOVERS._value.get()
            later = [session.step(token) for token in tokens]  # the session is gone: the client replays it
            assert metrics.FAILOVERS._value.get() == failovers + 1
            assert server.peer_id not in model.client.bans.current()  # a session it closed is no fault of its
            assert free_cache(model.client, server) == CACHE_TOKENS - PAGE_TOKENS  # its new session's page
        for got, wanted in zip([first, *later], expected):
            torch.testing.assert_close(got, wanted, atol=1e-4, rtol=0)
        wait_for_free_cache(model.client, server, CACHE_TOKENS)
    finally:
        model.close()


def test_a_peer_is_refused_past_its_share_while_another_peer_gets_cache(tiny_swarm, clients):
    server = tiny_swarm.add_server(["--blocks", f"0:{TINY_BLOCKS}", "--dht-prefix", "shared", *SHARED])
    hog, other = clients
    theirs = open_sessions(other, "shared", 1)
    hoarded = open_sessions(hog, "shared", SHARE_LIMIT // PAGE_TOKENS)  # sessions it never steps: its share
    try:
        with pytest.raises(CacheFullError, match="over its share of 256 .*while other peers use this server"):
            open_sessions(hog, "shared", 1)
        theirs += open_sessions(other, "shared", 2)  # the other peer still gets cache
        assert theirs[-1].step(torch.randn(1, 3, 64)).shape == (1, 3, 64)
        assert free_cache(other, server) == CACHE_TOKENS - SHARE_LIMIT - 3 * PAGE_TOKENS
    finally:
        for session in [*hoarded, *theirs]:
            session.close()
    wait_for_free_cache(other, server, CACHE_TOKENS)


def test_a_peer_that_took_all_the_cache_first_makes_room_for_another(tiny_swarm, clients):
    """Alone, a peer may use the whole cache (a gateway on its own small swarm); when another peer comes, the
    first one's least recently stepped sessions are closed to make room for it, and it gets no more."""
    server = tiny_swarm.add_server(["--blocks", f"0:{TINY_BLOCKS}", "--dht-prefix", "reclaim", *SHARED])
    hog, other = clients
    hoarded = open_sessions(hog, "reclaim", CACHE_TOKENS // PAGE_TOKENS)  # all of it
    theirs = []
    try:
        assert free_cache(other, server) == 0
        theirs = open_sessions(other, "reclaim", 2)
        assert theirs[-1].step(torch.randn(1, 3, 64)).shape == (1, 3, 64)
        assert free_cache(other, server) == 0
        assert server.log_path.read_text().count("(reclaimed), freeing 16 cache tokens") == 2
        with pytest.raises(CacheFullError, match="over its share"):  # now that the cache is shared
            open_sessions(hog, "reclaim", 1)
    finally:
        for session in [*hoarded, *theirs]:
            session.close()
    wait_for_free_cache(other, server, CACHE_TOKENS)
