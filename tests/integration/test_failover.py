"""Fault tolerance on a real localhost swarm with two replicas of each span: servers die (kill -9) or stall
(SIGSTOP) in the middle of a generation (greedy, or sampled with a seed), and every generation completes with
the no-fault output."""

import signal
import time

import pytest
import torch

from config import AccessSettings, GatewaySettings, ModelConfig, Settings, SwarmSettings
from exact_match import ATOL
from swarm.client import SwarmClient
from swarm.local import LocalSwarm
from swarm.client.remote_model import InferenceSession, RemoteModel
from swarm.protocol import PAGE_TOKENS

PREFIX = "chaos"
NEW_TOKENS = 48  # past the last round's fault (step 40)
SPANS = [(0, 2), (2, 4)]


@pytest.fixture(scope="module")
def chaos_swarm(tiny_llama, tmp_path_factory):
    swarm = LocalSwarm(str(tiny_llama), SPANS * 2, server_args=["--dht-prefix", PREFIX],
                       log_dir=tmp_path_factory.mktemp("chaos-logs"))
    with swarm:
        yield swarm


@pytest.fixture(scope="module")
def model(chaos_swarm, tiny_llama):
    # a short step timeout, so that a stalled server is noticed within seconds
    remote = RemoteModel(tiny_llama, SwarmClient(chaos_swarm.initial_peers, step_timeout=1.5), str(tiny_llama), PREFIX)
    yield remote
    remote.close()


PROMPT = [5, 17, 42, 99, 7, 250, 31]


def greedy(model, on_step=lambda step, session: None) -> list[int]:
    tokens = []
    with model.session(max_length=len(PROMPT) + NEW_TOKENS) as session:
        logits = session.step([PROMPT])
        for step in range(NEW_TOKENS):
            tokens.append(int(logits[0].argmax()))
            on_step(step, session)
            logits = session.step([[tokens[-1]]])
    return tokens


@pytest.fixture(scope="module")
def reference(model) -> list[int]:
    return greedy(model)


def server_of(swarm, peer_id):
    return next(server for server in swarm.servers if server.peer_id == peer_id)


def replace_server(swarm, victim):
    """Start a new server for the victim's span (it announces itself a few seconds later)."""
    span = next(span for span in SPANS if f"blocks {span[0]}:{span[1]} " in victim.ready_line)
    return swarm.add_server(["--blocks", f"{span[0]}:{span[1]}"], wait=False)


def wait_ready(server):
    if server.ready_line is None:
        server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), 120)


@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_generation_survives_faults_with_identical_output(chaos_swarm, model, reference, fault):
    rounds = 2  # a fault on each hop of the chain, each at another step (the seeded tests below strike again)
    replacements = {}  # hop index -> the server started to replace the last victim there
    for round_ in range(rounds):
        victims = []
        if round_ % 2 in replacements:  # two live replicas of the span this round strikes
            wait_ready(replacements.pop(round_ % 2))

        def strike(step, session: InferenceSession):
            if step == 7 + round_ * 11:  # a different step each round, on alternating hops of the chain
                peer = session.blocks.chain[round_ % 2].peer_id
                victim = server_of(chaos_swarm, peer)
                victim.process.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                victims.append(victim)

        began = time.monotonic()
        assert greedy(model, strike) == reference, f"round {round_}"
        assert victims, "the fault was injected"
        assert time.monotonic() - began < 60
        for victim in victims:
            if fault == "stall":
                victim.process.send_signal(signal.SIGKILL)  # the stalled one leaves for good
            victim.process.wait(10)
            replacements[round_ % 2] = replace_server(chaos_swarm, victim)
    for server in replacements.values():
        wait_ready(server)


def test_when_nothing_can_serve_the_span_the_error_names_the_blocks(tiny_llama, tmp_path):
    from swarm.protocol import MissingBlocksError

    with LocalSwarm(str(tiny_llama), SPANS, server_args=["--dht-prefix", "fragile"], log_dir=tmp_path) as swarm:
        remote = RemoteModel(tiny_llama, SwarmClient(swarm.initial_peers, step_timeout=1.5, max_retries=2),
                             str(tiny_llama), "fragile")
        try:
            with remote.session(max_length=16) as session:
                session.step([PROMPT])
                server_of(swarm, session.blocks.chain[1].peer_id).process.send_signal(signal.SIGKILL)
                with pytest.raises(MissingBlocksError, match=r"no server holds blocks 2\.\.3"):
                    session.step([[1]])
        finally:
            remote.close()


def test_a_dead_server_leaves_routing_quickly(tiny_swarm):
    from config import SwarmSettings

    assert 3 * SwarmSettings(cache_dir=".").announce_period <= 30  # the default: gone within 30 s
    server = tiny_swarm.add_server(["--blocks", "0:4", "--dht-prefix", "mortal", "--announce-period", "2"])
    client = SwarmClient(tiny_swarm.initial_peers)
    try:
        assert len(client.servers("mortal", 4)) == 1
        server.process.send_signal(signal.SIGKILL)
        began = time.monotonic()
        while client.servers("mortal", 4) and time.monotonic() - began < 20:
            time.sleep(0.5)
        assert client.servers("mortal", 4) == [] and time.monotonic() - began <= 3 * 2 + 2
    finally:
        client.shutdown()


# ------------------------------------------------------------------ seeded sampling through the gateway's engine

SEEDED_TOKENS = 40


@pytest.fixture(scope="module")
def engine(chaos_swarm, tiny_llama, settings):
    from gateway.engine.generation import Engine

    # one trusted user without keys (KEYLESS_SHARING): its requests continue each other's warm conversations
    gateway = GatewaySettings(models=(ModelConfig("tiny", str(tiny_llama), dht_prefix=PREFIX),),
                              access=AccessSettings(keyless_sharing=True))
    swarm = SwarmSettings(cache_dir=settings.cache_dir, initial_peers=tuple(chaos_swarm.initial_peers))
    engine = Engine(Settings(swarm=swarm, gateway=gateway))
    yield engine
    engine.swarm_client().shutdown()


def sampling(engine, seed):
    from gateway.engine.sampling import SamplingParams

    eos = engine.model("tiny").tokenizer.eos_token_id  # never sampled: every reply runs its full length
    return SamplingParams(do_sample=True, temperature=1.0, seed=seed, logit_bias={eos: -100})


def reply(engine, params, on_token=lambda count, session: None) -> list[int]:
    """The engine's reply to PROMPT as token ids; on_token(tokens so far, session) runs after each token."""
    from gateway.engine.generation import GenerationRequest

    session = engine.open_session("tiny", len(PROMPT) + SEEDED_TOKENS, expires=False)
    request = GenerationRequest(inputs=None, sampling=params, max_new_tokens=SEEDED_TOKENS,
                                input_ids=tuple(PROMPT), logprobs=0)
    tokens = []
    try:
        for delta in engine.generate(session, request):
            tokens += [entry.token_id for entry in delta.logprobs]
            on_token(len(tokens), session)
    finally:
        engine.close_session(session)
    return tokens


@pytest.mark.parametrize("hop, at_token", [(0, 9), (1, 23)])
def test_a_seeded_sample_is_identical_when_a_server_dies_mid_reply(chaos_swarm, engine, hop, at_token):
    """A seeded, sampled reply of the gateway's engine (temperature 1) is the same whether or not its chain loses a
    server on the way: a replica takes over (the session's inputs replayed to it), and every token equals the
    undisturbed reply's. What docs/servers.md's fault tolerance promises, for sampling as well as greedy decoding."""
    from gateway.engine.sampling import SamplingParams

    reference = reply(engine, sampling(engine, seed=11))
    assert len(reference) == SEEDED_TOKENS
    assert reference != reply(engine, SamplingParams())  # sampled, not greedy
    assert reference != reply(engine, sampling(engine, seed=12))  # and the seed decides it

    victims, chains = [], []

    def strike(count, session):
        if count == at_token:
            peer = session.inference.blocks.chain[hop].peer_id
            victims.append(server_of(chaos_swarm, peer))
            victims[-1].process.send_signal(signal.SIGKILL)
        chains.append([link.peer_id for link in session.inference.blocks.chain])

    assert reply(engine, sampling(engine, seed=11), strike) == reference
    assert len(victims) == 1 and victims[0].process.wait(10) == -signal.SIGKILL
    assert chains[-1][hop] != victims[0].peer_id  # a replica took the dead server's place in the chain
    span = SPANS[hop]  # back to two replicas of each span for the next case
    chaos_swarm.add_server(["--blocks", f"{span[0]}:{span[1]}"])


# ------------------------------------------------------------------ a warm conversation whose server died


def greedy_reply(engine, prompt: list[int], tokens: int) -> tuple[object, list[int], int]:
    """(session, reply ids, tokens reused) of the engine's greedy reply to `prompt`, the session given back (parked)."""
    from gateway.engine.generation import GenerationRequest
    from gateway.engine.sampling import SamplingParams

    model = engine.model("tiny")
    session, cached = engine.open_for_prompt(model, prompt, len(prompt) + tokens, owner="key:warm")
    request = GenerationRequest(inputs=None, sampling=SamplingParams(), max_new_tokens=tokens,
                                input_ids=tuple(prompt[cached:]), logprobs=0)
    try:
        with engine.sessions.use(session.id):
            ids = [entry.token_id for delta in engine.generate(session, request) for entry in delta.logprobs]
    finally:
        engine.finish_session(session)
    return session, ids, cached


def test_a_warm_conversation_whose_server_died_is_recomputed_with_identical_output(chaos_swarm, engine, model):
    first_prompt = PROMPT * 4
    session, first, _ = greedy_reply(engine, first_prompt, 8)
    follow_up = first_prompt + first[:-1] + [3, 1, 4, 1, 5]  # the servers hold all but the last reply token
    victim = server_of(chaos_swarm, session.inference.blocks.chain[1].peer_id)
    victim.process.send_signal(signal.SIGKILL)  # the second hop of the parked conversation dies meanwhile
    again, second, cached = greedy_reply(engine, follow_up, 8)
    # reused as far as the gateway knows (by whole pages)...
    assert again is session and cached == (len(follow_up) - 5) // PAGE_TOKENS * PAGE_TOKENS > 0
    assert victim.peer_id not in [link.peer_id for link in session.inference.blocks.chain]  # ...but recomputed there
    with model.session(max_length=len(follow_up) + 8) as fresh:  # the same prompt on fresh sessions, no reuse
        logits, expected = fresh.step([follow_up]), []
        for _ in range(8):
            expected.append(int(logits[0].argmax()))
            logits = fresh.step([[expected[-1]]])
    assert second == expected
    victim.process.wait(10)
    chaos_swarm.add_server(["--blocks", f"{SPANS[1][0]}:{SPANS[1][1]}"], wait=False)  # two replicas again


def test_a_draft_rejected_after_a_failover_replays_only_the_accepted_tokens(chaos_swarm, model):
    """Speculative decoding meets a failover: the servers hold a draft, the second hop dies, and the next step
    keeps only the draft's first two tokens. The replacement is given the accepted tokens only (the inputs replayed
    end where the step begins), and the outputs equal a session that never saw the rejected ones."""
    draft = [11, 12, 13, 14, 15, 16]
    for server in chaos_swarm.servers:  # the replica an earlier test started: the victim's blocks need it
        if server.process.poll() is None:
            wait_ready(server)
    with model.session(max_length=len(PROMPT) + 16) as session:
        first = int(session.step([PROMPT])[0].argmax())
        session.step([[first] + draft], every_position=True)
        victim = server_of(chaos_swarm, session.blocks.chain[1].peer_id)
        victim.process.send_signal(signal.SIGKILL)
        logits = session.step([[9]], position=len(PROMPT) + 3)  # first, 11, 12 accepted; 9 chosen after them
        assert victim.peer_id not in [link.peer_id for link in session.blocks.chain]
    with model.session(max_length=len(PROMPT) + 4) as fresh:
        expected = fresh.step([PROMPT + [first, 11, 12, 9]])
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
    victim.process.wait(10)
    chaos_swarm.add_server(["--blocks", f"{SPANS[1][0]}:{SPANS[1][1]}"], wait=False)  # two replicas again
