"""A server that fails on its own (out of memory, a bug) mid-generation: its clients treat it as an unavailable
server (ban, fail over to a replica, replay), and every session's tokens equal the local model's."""

import threading

import pytest
import torch
import transformers

from faulty_server import add_faulty_server
from swarm.client import SwarmClient, metrics
from swarm.client.remote_model import RemoteModel
from swarm.client.routing import ChainLink
from swarm.local import READY_TIMEOUT

PREFIX = "erring"
FAIL_AFTER = 4  # compute rounds the erring server runs well; every later one fails
PROMPTS = [[5, 17, 42, 99, 7], [3, 250, 31, 8, 64, 11]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def servers(tiny_swarm, tiny_llama):
    """Blocks 0:2 on an honest server; blocks 2:4 on the erring server, on one that fails every round, and on
    an honest replica."""
    blocks = ["--dht-prefix", PREFIX, "--blocks"]
    first = tiny_swarm.add_server([*blocks, "0:2"], wait=False)
    replica = tiny_swarm.add_server([*blocks, "2:4"], wait=False)
    erring = add_faulty_server(tiny_swarm, [*blocks, "2:4"], fail_after=FAIL_AFTER, wait=False)
    broken = add_faulty_server(tiny_swarm, [*blocks, "2:4"], fail_after=0, wait=False)
    started = [first, replica, erring, broken]
    try:
        for server in started:
            server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), READY_TIMEOUT)
        yield first, erring, replica, broken
    finally:
        for server in started:
            server.stop()


def local_greedy(tiny_llama, prompt: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False)[0].tolist()
    return ids[len(prompt):]


def greedy(session, prompt: list[int]) -> list[int]:
    tokens = [int(session.step([prompt])[0].argmax())]
    while len(tokens) < NEW_TOKENS:
        tokens.append(int(session.step([[tokens[-1]]])[0].argmax()))
    return tokens


def internal_failovers() -> float:
    return metrics.FAILOVER_CAUSES.labels("internal_error")._value.get()


def test_sessions_fail_over_from_a_server_that_fails_on_its_own(tiny_swarm, tiny_llama, servers, caplog):
    first, erring, replica, broken = servers
    # at first only the erring server may serve blocks 2:4, so that the sessions start on it
    client = SwarmClient(tiny_swarm.initial_peers, allowed_servers=[first.peer_id, erring.peer_id])
    model = RemoteModel(tiny_llama, client, str(tiny_llama), PREFIX)
    before = internal_failovers()
    try:
        sessions = [model.session(max_length=len(prompt) + NEW_TOKENS) for prompt in PROMPTS]
        assert all([link.peer_id for link in session.blocks.chain] == [first.peer_id, erring.peer_id]
                   for session in sessions)
        client.allowed_servers = frozenset({first.peer_id, erring.peer_id, replica.peer_id})  # the replica may take over
        results: dict[int, object] = {}

        def generate(index):  # at once, so that the sessions' steps share the erring server's rounds
            try:
                results[index] = greedy(sessions[index], PROMPTS[index])
            except Exception as error:  # shown by the assertion below
                results[index] = error

        threads = [threading.Thread(target=generate, args=(index,)) for index in range(len(PROMPTS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert [results.get(index) for index in range(len(PROMPTS))] == \
            [local_greedy(tiny_llama, prompt) for prompt in PROMPTS]
        for session in sessions:
            assert [link.peer_id for link in session.blocks.chain] == [first.peer_id, replica.peer_id]
            session.close()
    finally:
        model.close()
    assert internal_failovers() == before + len(PROMPTS)  # one failover each, counted by its cause
    assert erring.peer_id in client.bans.current()
    assert erring.process.poll() is None  # it did not die: it failed on its own, and said so
    assert any("internal_error" in record.getMessage() and erring.peer_id in record.getMessage()
               for record in caplog.records)


def test_a_cacheless_forward_is_routed_around_a_server_that_fails(tiny_swarm, tiny_llama, servers):
    """Whole-sequence logits (no session: echo with logprobs, embeddings) survive a server's own failure too."""
    first, erring, replica, broken = servers
    client = SwarmClient(tiny_swarm.initial_peers, allowed_servers=[first.peer_id, broken.peer_id, replica.peer_id])
    model = RemoteModel(tiny_llama, client, str(tiny_llama), PREFIX)
    routed = []
    choose = client.wait_for_chain

    def via_the_broken_server_first(*args, **kwargs):  # routing would pick either: the broken one goes first
        routed.append(kwargs.get("start", 0))
        if len(routed) == 1:
            return [ChainLink(first.peer_id, 0, 2), ChainLink(broken.peer_id, 2, 4)]
        return choose(*args, **kwargs)

    client.wait_for_chain = via_the_broken_server_first
    local = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    try:
        logits = model.forward(torch.tensor([PROMPTS[0]]))
    finally:
        model.close()
    with torch.no_grad():
        expected = local(torch.tensor([PROMPTS[0]])).logits
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert routed == [0, 2]  # blocks 0:2 ran once; only the failed hop's blocks were routed again
    assert broken.peer_id in client.bans.current()
