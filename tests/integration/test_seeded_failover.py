"""A seeded, sampled reply is the same whether or not its chain loses a server on the way: the gateway's engine
samples at temperature 1 with a seed while a server of the session's chain is killed (kill -9) mid-reply; a
replica takes over (the client replays the session's inputs to it), and every token equals the undisturbed
reply's. What the README's fault tolerance promises, for sampling as well as for greedy decoding."""

import signal

import pytest

from config import GatewaySettings, ModelConfig, Settings, SwarmSettings
from swarm.local import LocalSwarm

PREFIX = "seeded-chaos"
SPANS = [(0, 2), (2, 4)]
PROMPT = (5, 17, 42, 99, 7, 250, 31)
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def chaos_swarm(tiny_llama, tmp_path_factory):
    swarm = LocalSwarm(str(tiny_llama), SPANS * 2, server_args=["--dht-prefix", PREFIX],  # two replicas of each span
                       log_dir=tmp_path_factory.mktemp("seeded-chaos-logs"))
    with swarm:
        yield swarm


@pytest.fixture(scope="module")
def engine(chaos_swarm, tiny_llama, settings):
    from gateway.engine import Engine

    gateway = GatewaySettings(models=(ModelConfig("tiny", str(tiny_llama), dht_prefix=PREFIX),))
    swarm = SwarmSettings(cache_dir=settings.cache_dir, initial_peers=tuple(chaos_swarm.initial_peers))
    engine = Engine(Settings(swarm=swarm, gateway=gateway))
    yield engine
    engine.swarm_client().shutdown()


def sampling(engine, seed):
    from gateway.sampling import SamplingParams

    eos = engine.model("tiny").tokenizer.eos_token_id  # never sampled: every reply runs its full length
    return SamplingParams(do_sample=True, temperature=1.0, seed=seed, logit_bias={eos: -100})


def reply(engine, params, on_token=lambda count, session: None) -> list[int]:
    """The engine's reply to PROMPT as token ids; on_token(tokens so far, session) runs after each token."""
    from gateway.engine import GenerationRequest

    session = engine.open_session("tiny", len(PROMPT) + NEW_TOKENS, expires=False)
    request = GenerationRequest(inputs=None, sampling=params, max_new_tokens=NEW_TOKENS, input_ids=PROMPT, logprobs=0)
    tokens = []
    try:
        for delta in engine.generate(session, request):
            tokens += [entry.token_id for entry in delta.logprobs]
            on_token(len(tokens), session)
    finally:
        engine.close_session(session)
    return tokens


def server_of(swarm, peer_id):
    return next(server for server in swarm.servers if server.peer_id == peer_id)


@pytest.mark.parametrize("hop, at_token", [(0, 9), (1, 23)])
def test_a_seeded_sample_is_identical_when_a_server_dies_mid_reply(chaos_swarm, engine, hop, at_token):
    from gateway.sampling import SamplingParams

    reference = reply(engine, sampling(engine, seed=11))
    assert len(reference) == NEW_TOKENS
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
