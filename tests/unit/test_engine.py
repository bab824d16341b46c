"""The one generation loop, over a stand-in for the swarm that runs the tiny model in process."""

import time

import pytest
import torch

from config import AccessSettings, GatewaySettings, Limits, ModelConfig, Settings, SwarmSettings
from gateway.engine.generation import Engine, GenerationRequest
from gateway.errors import BadRequest, LengthExceeded, NotFound, TooManySessions
from gateway.engine.sampling import SamplingParams
from local_remote import LocalRemote
from swarm.protocol import PAGE_TOKENS


@pytest.fixture(scope="module")
def remote(tiny_llama):
    return LocalRemote(tiny_llama)


@pytest.fixture
def engine(tiny_llama, remote, tmp_path):
    # one trusted user without keys (KEYLESS_SHARING): its requests continue each other's warm conversations
    gateway = GatewaySettings(models=(ModelConfig("tiny", str(tiny_llama), max_session_length=64),),
                              limits=Limits(max_sessions=2, session_idle_timeout=0.2),
                              access=AccessSettings(keyless_sharing=True))
    # sessions that should not expire mid-test are opened with expires=False: under load, the 0.2 s (which
    # test_cap_and_idle_expiry needs) can pass between two steps of a test
    return Engine(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway), connect=lambda config: remote)


def greedy(max_new_tokens=None, inputs=None, **fields):
    return GenerationRequest(inputs=inputs, sampling=SamplingParams(), max_new_tokens=max_new_tokens, **fields)


def run(engine, session, request, **kwargs):
    with engine.sessions.use(session.id):  # as the APIs do: held sessions never expire mid-reply
        deltas = list(engine.generate(session, request, **kwargs))
    return "".join(delta.text for delta in deltas), deltas


def reference_tokens(remote, ids, count):
    with torch.no_grad():
        output = remote.model.generate(torch.tensor([ids]), max_new_tokens=count, min_new_tokens=count, do_sample=False)
    return output[0, len(ids):].tolist()


def test_greedy_reply_equals_transformers_and_continues_without_resending(engine, remote):
    session = engine.open_session("tiny", 64, expires=False)
    first_ids = remote.tokenizer("Hello, world!")["input_ids"]
    text, deltas = run(engine, session, greedy(6, inputs="Hello, world!"))
    generated = reference_tokens(remote, first_ids, 6)
    assert text == remote.tokenizer.decode(generated) and deltas[-1].finish_reason == "length"
    assert sum(delta.token_count for delta in deltas) == 6

    more_ids = remote.tokenizer(" How are you?", add_special_tokens=False)["input_ids"]
    text, _ = run(engine, session, greedy(4, inputs=" How are you?"))
    sent = remote.sessions[-1].sent
    assert sent[6] == [generated[-1], *more_ids]  # the pending token and the new text, nothing older
    history = first_ids + generated + more_ids
    assert text == remote.tokenizer.decode(reference_tokens(remote, history, 4))


def test_stop_sequence_ends_the_reply(engine, remote):
    session = engine.open_session("tiny", 64, expires=False)
    full, _ = run(engine, session, greedy(12, inputs="The quick"))
    engine.close_session(session)
    stop = full[4:9]
    session = engine.open_session("tiny", 64, expires=False)
    text, deltas = run(engine, session, greedy(12, inputs="The quick", stop_sequences=(stop,)))
    assert text == full[: full.index(stop) + len(stop)]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_sequence == stop


def test_cancel_ends_the_reply_and_keeps_the_session(engine):
    session = engine.open_session("tiny", 64, expires=False)
    calls = iter(range(100))
    _, deltas = run(engine, session, greedy(10, inputs="Hi"), cancelled=lambda: next(calls) >= 3)
    assert deltas[-1].finish_reason == "cancelled" and sum(d.token_count for d in deltas) == 3
    text, _ = run(engine, session, greedy(2, inputs=" again"))
    assert not session.closed


def test_lengths(engine):
    session = engine.open_session("tiny", 8, expires=False)
    with pytest.raises(LengthExceeded, match="max_length of 8"):
        run(engine, session, greedy(1, inputs="The quick brown fox jumps over the lazy dog."))
    _, deltas = run(engine, session, greedy(None, inputs="Hi"))  # until the session is full
    assert deltas[-1].finish_reason == "length" and len(session.history) + len(session.pending) == 8
    with pytest.raises(BadRequest, match="max_length: at most 64"):
        engine.open_session("tiny", 65, expires=True)


def test_prefill_only_and_inputs_required(engine, remote):
    session = engine.open_session("tiny", 64, expires=False)
    with pytest.raises(BadRequest, match="inputs: required"):
        run(engine, session, greedy(3))
    _, deltas = run(engine, session, greedy(0, inputs="Hello"))
    assert deltas == [deltas[0]] and deltas[0].token_count == 0 and session.pending == []
    assert remote.sessions[-1].ids == remote.tokenizer("Hello")["input_ids"]


def test_cap_and_idle_expiry(engine, remote):
    first = engine.open_session("tiny", 16, expires=True)
    engine.open_session("tiny", 16, expires=False)
    with pytest.raises(TooManySessions):
        engine.open_session("tiny", 16, expires=True)
    time.sleep(0.6)
    engine.sessions.expire_idle()  # the registry's reaper thread may have done it already
    assert first.closed and remote.sessions[-2].closed
    assert len(engine.sessions) == 1  # the WebSocket-style session does not expire
    with pytest.raises(NotFound):
        engine.sessions.get(first.id)
    engine.open_session("tiny", 16, expires=True)


def test_unknown_model(engine):
    with pytest.raises(NotFound, match="unknown model 'nope'; served models: tiny"):
        engine.open_session("nope", 16, expires=True)


# ------------------------------------------------------------------------------------------ warm conversations


def test_a_finished_prompt_is_kept_warm_and_the_next_one_sends_only_its_new_tokens(engine, remote):
    model = engine.model("tiny")
    prompt = model.encode("a conversation that goes on and on", at_start=True)
    session, cached = engine.open_for_prompt(model, prompt, len(prompt) + 4, owner="key:a")
    assert cached == 0
    with engine.sessions.use(session.id):
        first = "".join(delta.text for delta in engine.generate(session, greedy(4, input_ids=tuple(prompt))))
    engine.finish_session(session)
    assert len(engine.sessions) == 0 and len(engine.warm) == 1 and not session.closed
    held = session.history
    follow_up = held + model.encode(" and then", at_start=False)
    again, cached = engine.open_for_prompt(model, follow_up, len(follow_up) + 4, owner="key:a")
    assert again is session and cached == len(held) - len(held) % PAGE_TOKENS > 0  # by whole pages
    sent = len(session.inference.sent)
    with engine.sessions.use(again.id):
        list(engine.generate(again, greedy(4, input_ids=tuple(follow_up[cached:]))))
    assert session.inference.sent[sent] == follow_up[cached:]  # only the new tokens went to the "servers"
    assert first


def test_a_session_whose_step_failed_is_never_kept(engine, remote):
    model = engine.model("tiny")
    prompt = model.encode("a conversation that fails midway through", at_start=True)
    session, _ = engine.open_for_prompt(model, prompt, len(prompt) + 4, owner="key:a")
    session.inference.step = lambda *args, **kwargs: (_ for _ in ()).throw(ConnectionError("a server vanished"))
    with pytest.raises(ConnectionError), engine.sessions.use(session.id):
        list(engine.generate(session, greedy(4, input_ids=tuple(prompt))))
    engine.finish_session(session)
    assert session.closed and session.broken and len(engine.warm) == 0
