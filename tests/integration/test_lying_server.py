"""Spot checks against a real lying server: one serves a copy of the tiny model whose block weights differ. A
client that checks every step catches it on the first step, bans it, and its generation equals the honest one."""

import pytest

from shared_swarm import TINY_BLOCKS
from swarm.client import SwarmClient
from swarm.client.remote_model import RemoteModel
from swarm.client.routing import ChainLink
from tiny_model import build_tiny_model

PREFIX = "spot"
PROMPT = [5, 17, 42, 99, 7]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def servers(tiny_swarm, tmp_path_factory):
    """Two honest servers of every block, and a liar: the tiny model's shape, other block weights (seed 1)."""
    liar_model = build_tiny_model(tmp_path_factory.mktemp("liar"), "llama", TINY_BLOCKS, seed=1)
    blocks = ["--blocks", f"0:{TINY_BLOCKS}", "--dht-prefix", PREFIX]
    started = [tiny_swarm.add_server(blocks, wait=False) for _ in range(2)]
    started.append(tiny_swarm.add_server(["--model", str(liar_model), *blocks], wait=False))
    for server in started:
        server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), 120)
    yield started
    for server in started:
        server.stop()


def greedy(session) -> list[int]:
    tokens = [int(session.step([PROMPT])[0].argmax())]
    for _ in range(NEW_TOKENS - 1):
        tokens.append(int(session.step([[tokens[-1]]])[0].argmax()))
    return tokens


def caught() -> float:
    from swarm.client import metrics

    return metrics.SPOT_CHECKS.labels("caught")._value.get()


def test_a_lying_server_is_caught_banned_and_routed_around(tiny_swarm, tiny_llama, tiny_remote, servers):
    *honest, liar = servers
    with tiny_remote.session(max_length=len(PROMPT) + NEW_TOKENS) as session:
        reference = greedy(session)
    model = RemoteModel(tiny_llama, SwarmClient(tiny_swarm.initial_peers, spot_check_rate=1.0), str(tiny_llama), PREFIX)
    try:
        hidden = model.embed([PROMPT])
        truth, lie = (model.client.forward([ChainLink(server.peer_id, 0, TINY_BLOCKS)], hidden)
                      for server in (honest[0], liar))
        assert (truth - lie).abs().max() > 1  # the liar does lie

        model.client.allowed_servers = frozenset([liar.peer_id])  # so that the session starts on the liar
        with model.session(max_length=len(PROMPT) + NEW_TOKENS) as session:
            model.client.allowed_servers = frozenset()  # now any server may check it, or replace it
            before = caught()
            assert greedy(session) == reference
            assert caught() == before + 1 and liar.peer_id in model.client.bans.current()
            assert [link.peer_id for link in session.blocks.chain] != [liar.peer_id]
    finally:
        model.close()


@pytest.fixture(scope="module")
def misshaping(tiny_swarm, servers):
    """A server of every block whose steps answer with outputs one column short (the liar of the test above
    and the honest servers are up already)."""
    from faulty_server import add_faulty_server

    return add_faulty_server(tiny_swarm, ["--blocks", f"0:{TINY_BLOCKS}", "--dht-prefix", PREFIX], malformed="shape")


def test_a_server_answering_with_misshapen_outputs_is_banned_and_routed_around(tiny_swarm, tiny_llama, tiny_remote,
                                                                              servers, misshaping):
    """Its outputs never reach the LM head (which merges concurrent sessions' rows: a wrong shape there failed
    them all): the session bans it as a liar, replays on an honest server, and generates as the honest ones do
    (before: the step failed with a shape error, and the server stayed in favour)."""
    with tiny_remote.session(max_length=len(PROMPT) + NEW_TOKENS) as session:
        reference = greedy(session)
    model = RemoteModel(tiny_llama, SwarmClient(tiny_swarm.initial_peers), str(tiny_llama), PREFIX)
    try:
        model.client.allowed_servers = frozenset([misshaping.peer_id])  # so that the session starts there
        with model.session(max_length=len(PROMPT) + NEW_TOKENS) as session:
            *honest, _ = servers  # not the other liar: no spot check here to catch it
            model.client.allowed_servers = frozenset(server.peer_id for server in [*honest, misshaping])
            assert greedy(session) == reference
            assert misshaping.peer_id in model.client.bans.distrusted()
            assert misshaping.peer_id not in [link.peer_id for link in session.blocks.chain]
    finally:
        model.close()
