"""Flowing steps on real servers (swarm/client/flowing.py): a step goes once to each server of a three-hop chain,
its inputs only to the first, and flows down by the servers' pushes. Its outputs equal relayed steps' (greedy and
seeded sampling); a lost push costs a round trip, not the session; a server killed in the middle of a flowing
chain is failed over with identical outputs."""

import signal

import pytest
import torch

import swarm.client.step_channel as step_channel
from swarm.client import SwarmClient
from swarm.client.remote_model import RemoteModel
from swarm.client.stubs import InferenceStream

PREFIX = "flowing"
SPANS = ["0:2", "2:3", "2:3", "3:4"]  # a chain of three hops; the middle one has a replica to fail over to
PROMPT = [5, 17, 42, 99, 7, 250, 31]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def servers(tiny_swarm):
    started = [tiny_swarm.add_server(["--blocks", span, "--dht-prefix", PREFIX], wait=False) for span in SPANS]
    for server in started:
        server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), 180)
    return started


@pytest.fixture(scope="module")
def model(tiny_swarm, tiny_llama, servers):
    # a short step timeout, so that a killed server is noticed within seconds
    remote = RemoteModel(tiny_llama, SwarmClient(tiny_swarm.initial_peers, step_timeout=3.0), str(tiny_llama),
                         PREFIX)
    yield remote
    remote.close()


def generate(model, flowing: bool, seed=None, on_step=lambda step, session: None, grace=None):
    """Tokens (greedy, or sampled with `seed`) and every step's logits."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    tokens, logits_seen = [], []
    with model.session(max_length=len(PROMPT) + NEW_TOKENS + 1) as session:
        session.blocks.flowing = flowing
        if grace is not None:
            session.blocks.flow_grace = grace
        logits = session.step([PROMPT])
        for step in range(NEW_TOKENS):
            logits_seen.append(logits)
            if generator is None:
                tokens.append(int(logits[0].argmax()))
            else:
                tokens.append(int(torch.multinomial(torch.softmax(logits[0].float(), -1), 1, generator=generator)))
            on_step(step, session)
            logits = session.step([[tokens[-1]]])
        missed = session.blocks.pushes_missed
    return tokens, torch.stack(logits_seen), missed


@pytest.fixture(scope="module")
def relayed(model):
    return {seed: generate(model, flowing=False, seed=seed) for seed in (None, 7)}


@pytest.mark.parametrize("seed", [None, 7])
def test_flowing_steps_equal_relayed_ones(model, relayed, seed):
    tokens, logits, missed = generate(model, flowing=True, seed=seed)
    assert tokens == relayed[seed][0]
    assert torch.equal(logits, relayed[seed][1])
    assert missed == 0, "every push came in time"


def test_a_flowing_step_sends_the_client_message_once_per_hop_with_inputs_only_to_the_first(model, monkeypatch):
    packed = []
    pack = step_channel._pack

    def recording(steps, message_id):
        packed.append([(step.hidden is not None, step.entry.get("await_push", False)) for step in steps])
        return pack(steps, message_id)

    monkeypatch.setattr(step_channel, "_pack", recording)
    with model.session(max_length=16) as session:
        session.blocks.flowing = True
        session.step([PROMPT])
        assert len(session.blocks.hops) == 3
        packed.clear()
        session.step([[3]])
        messages = list(packed)
    assert sorted(messages) == [[(False, True)], [(False, True)], [(True, False)]], messages


def test_a_lost_push_costs_a_round_trip_not_the_session(model, relayed, monkeypatch):
    """The first server is never asked to push: the second server's flowing step gets no push, and the client
    sends it the inputs itself once the grace has passed (then relays to it for a while)."""
    step = InferenceStream.step

    async def never_pushing(self, hidden, position, timeout=None, step_id=0, push_to=None, *args):
        return await step(self, hidden, position, timeout, step_id, None if self.start == 0 else push_to, *args)

    monkeypatch.setattr(InferenceStream, "step", never_pushing)
    tokens, logits, missed = generate(model, flowing=True, grace=0.2)
    assert tokens == relayed[None][0]
    assert torch.equal(logits, relayed[None][1])
    # the prompt's push to the second hop was lost and recovered; the next steps were relayed to it
    assert missed == 1


def test_failover_in_the_middle_of_a_flowing_chain_replays_exactly(model, relayed, tiny_swarm):
    victims = []

    def strike(step, session):
        if step == 5:
            peer = session.blocks.chain[1].peer_id
            victim = next(server for server in tiny_swarm.servers if server.peer_id == peer)
            victim.process.send_signal(signal.SIGKILL)
            victims.append(victim)

    tokens, logits, _ = generate(model, flowing=True, on_step=strike)
    assert victims, "the middle server was killed"
    assert tokens == relayed[None][0]
    torch.testing.assert_close(logits, relayed[None][1], atol=1e-4, rtol=0)


def test_a_chains_servers_open_the_session_at_once(model, monkeypatch):
    """A session's opening costs one server's round trips, not the chain's sum: the three hops' openings are all in
    flight together (remote_session.py _open_streams), and the session then steps as usual."""
    open_stream, in_flight, most = InferenceStream.open, [0], [0]

    async def counted_open(self, *args, **kwargs):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        try:
            return await open_stream(self, *args, **kwargs)
        finally:
            in_flight[0] -= 1

    monkeypatch.setattr(InferenceStream, "open", counted_open)
    with model.session(max_length=len(PROMPT) + 1) as session:
        assert len(session.blocks.hops) == 3
        assert session.step([PROMPT]).shape == (1, model.config.vocab_size)
    assert most[0] == 3
