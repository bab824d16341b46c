"""The engine loop on real block servers: a session whose chain is slow (a server with --simulated-latency) does
not slow a session of the same model on a fast chain, and both replies are the local model's."""

import threading
import time

import pytest
import torch
import transformers

from config import GatewaySettings, Limits, ModelConfig, Settings, SwarmSettings
from gateway.engine.generation import Engine, GenerationRequest
from gateway.engine.sampling import SamplingParams
from gateway.engine.served import GatewaySession
from shared_swarm import TINY_BLOCKS, TINY_PREFIX
from swarm.local import latency_args

SLOW_PREFIX = "slow-chain"
ROUND_TRIP_S = 0.3
TOKENS = 12
PROMPT = "a prompt for two chains"


@pytest.fixture(scope="module")
def slow_server(tiny_swarm):
    return tiny_swarm.add_server(["--blocks", f"0:{TINY_BLOCKS}", "--dht-prefix", SLOW_PREFIX,
                                  *latency_args(ROUND_TRIP_S * 1000)])


def reference(folder, ids, count):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        output = model.generate(torch.tensor([ids]), max_new_tokens=count, min_new_tokens=count, do_sample=False)
    return output[0, len(ids):].tolist()


def test_a_slow_chain_never_holds_a_fast_one(client, slow_server, tiny_llama, settings, tmp_path):
    from swarm.client import RemoteModel

    fast = RemoteModel.on_client(client, str(tiny_llama), settings.cache_dir, TINY_PREFIX, name="tiny")
    slow = RemoteModel.on_client(client, str(tiny_llama), settings.cache_dir, SLOW_PREFIX, name="tiny")
    gateway = GatewaySettings(models=(ModelConfig("tiny", str(tiny_llama), max_session_length=64),),
                              limits=Limits(speculative_tokens=0))
    engine = Engine(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway), connect=lambda config: fast)
    model = engine.model("tiny")
    request = GenerationRequest(inputs=PROMPT, sampling=SamplingParams(), max_new_tokens=TOKENS)
    slow_session = GatewaySession(model, slow.session(64), 64, expires=False)  # the same model, another chain
    fast_session = engine.open_session("tiny", 64, expires=False)
    replies, took = {}, {}

    def reply(name, session):
        began = time.monotonic()
        replies[name] = [delta.token_count for delta in engine.generate(session, request)]
        took[name] = time.monotonic() - began

    slow_thread = threading.Thread(target=reply, args=("slow", slow_session))
    slow_thread.start()
    time.sleep(ROUND_TRIP_S)  # the slow session's first step is in flight
    reply("fast", fast_session)
    slow_thread.join(60)
    assert took["slow"] >= TOKENS * ROUND_TRIP_S  # a round trip per token
    assert took["fast"] < TOKENS * ROUND_TRIP_S / 3  # and the fast chain went at its own pace meanwhile
    assert sum(replies["fast"]) == sum(replies["slow"]) == TOKENS
    expected = reference(tiny_llama, model.encode(PROMPT, at_start=True), TOKENS)
    for session in (fast_session, slow_session):
        assert (session.history + session.pending)[-TOKENS:] == expected
        session.close()
