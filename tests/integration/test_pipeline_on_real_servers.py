"""The engine loop's pipeline on real block servers (gateway/engine/loop.py, Pipeline): many sessions on a chain of
two servers travel in two groups, so that both servers have a group's step at the same time (in lockstep, the
second server's step always starts after the first's ends); a session alone is in no group and waits for none;
and the replies are the local model's either way."""

import time
from collections import defaultdict

import pytest
import torch
import transformers

from config import GatewaySettings, Limits, ModelConfig, Settings, SwarmSettings
from gateway.engine.generation import Engine
from gateway.engine.loop import EngineLoop, Pipeline
from gateway.engine.sampler import Sampler
from gateway.engine.sampling import SamplingParams
from gateway.engine.sequences import Sequence
from shared_swarm import TINY_PREFIX
from swarm.client import step_channel

TOKENS = 24
PROMPT = "a prompt in a pipeline"


@pytest.fixture
def in_flight(monkeypatch):
    """[sent, answered] of each message of short steps the client sends, by server."""
    intervals = defaultdict(list)
    send, answered = step_channel.StepChannel._send, step_channel.StepChannel.answered

    def timed_send(channel, steps, lane, message_id=None, message=None):
        send(channel, steps, lane, message_id, message)
        if lane is not None:
            intervals[channel.peer_id].append([time.monotonic(), None])

    def timed_answer(channel, stream, response):
        answered(channel, stream, response)
        open_ones = [interval for interval in intervals[channel.peer_id] if interval[1] is None]
        if open_ones:
            open_ones[0][1] = time.monotonic()

    monkeypatch.setattr(step_channel.StepChannel, "_send", timed_send)
    monkeypatch.setattr(step_channel.StepChannel, "answered", timed_answer)
    return intervals


def engine_of(client, tiny_llama, settings, tmp_path, pipeline: Pipeline) -> Engine:
    from swarm.client import RemoteModel

    model = RemoteModel.on_client(client, str(tiny_llama), settings.cache_dir, TINY_PREFIX, name="tiny")
    limits = Limits(speculative_tokens=0, pipeline_groups=pipeline.groups, pipeline_min_sessions=pipeline.min_sessions)
    gateway = GatewaySettings(models=(ModelConfig("tiny", str(tiny_llama), max_session_length=64),), limits=limits)
    return Engine(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway), connect=lambda config: model)


def generate_together(engine: Engine, count: int, pipeline: Pipeline) -> list[list[int]]:
    """`count` sessions submitted in one tick generate TOKENS greedy tokens each; each one's tokens."""
    model = engine.model("tiny")
    loop = EngineLoop(model, 0, pipeline)
    batch = []
    for _ in range(count):
        session = engine.open_session("tiny", 64, expires=False)
        feed = model.encode(PROMPT, at_start=True)
        batch.append(Sequence(session, feed, TOKENS, Sampler(SamplingParams(), model.vocab_size), None, set(), None))
    loop.submit(*batch)
    for sequence in batch:
        assert sequence.settled.wait(120) and sequence.stream.error is None, sequence.stream.error
    tokens = [sequence.generated for sequence in batch]
    for sequence in batch:
        sequence.session.close()
    return tokens


def overlap(first: list, second: list) -> float:
    """Seconds during which a message was in flight to each of the two servers at once."""
    return sum(max(0.0, min(a_end, b_end) - max(a_start, b_start))
               for a_start, a_end in first if a_end for b_start, b_end in second if b_end)


def reference(folder, ids) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        output = model.generate(torch.tensor([ids]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
    return output[0, len(ids):].tolist()


def test_two_groups_keep_both_servers_of_a_chain_busy_at_once(client, tiny_swarm, tiny_llama, settings, tmp_path,
                                                              in_flight, monkeypatch):
    monkeypatch.setenv("PUSHED_STEPS", "0")  # each server's step starts when the client sends it: clear intervals
    engine = engine_of(client, tiny_llama, settings, tmp_path, Pipeline(min_sessions=2))
    tokens = generate_together(engine, 16, Pipeline(min_sessions=2))
    first, second = (in_flight[server.peer_id] for server in tiny_swarm.servers[:2])
    assert len(first) >= 2 * (TOKENS - 1)  # a message per group and step: the groups travel apart
    # in step, the second server's step would only ever start after the first's came back (no overlap at all)
    assert overlap(first, second) > 0.25 * sum(end - start for start, end in first if end), "the servers took turns"
    expected = reference(tiny_llama, engine.model("tiny").encode(PROMPT, at_start=True))
    assert all(reply == expected for reply in tokens)


def test_sessions_in_step_give_the_same_replies(client, tiny_swarm, tiny_llama, settings, tmp_path):
    """PIPELINE_GROUPS=1: every session in one group (they may still drift apart, as arrivals split across ticks)."""
    engine = engine_of(client, tiny_llama, settings, tmp_path, Pipeline(groups=1))
    expected = reference(tiny_llama, engine.model("tiny").encode(PROMPT, at_start=True))
    assert all(reply == expected for reply in generate_together(engine, 16, Pipeline(groups=1)))


def test_a_session_alone_is_in_no_group_and_waits_for_none(client, tiny_swarm, tiny_llama, settings, tmp_path,
                                                           in_flight):
    engine = engine_of(client, tiny_llama, settings, tmp_path, Pipeline(min_sessions=2))
    generate_together(engine, 1, Pipeline(min_sessions=2))
    messages = [interval for intervals in in_flight.values() for interval in intervals]
    assert len(messages) == 2 * TOKENS  # one message per server per step (the prompt's and each decode step's)
    session = engine.open_session("tiny", 64, expires=False)
    assert session.inference.group == 0
