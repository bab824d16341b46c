"""n choices under the session caps: each fork of a request's prompt is a session on the servers, so it holds a slot
under MAX_SESSIONS and under its client's cap for as long as it lives (issue 39, item 3)."""

import pytest

from config import GatewaySettings, Limits, ModelConfig, Settings, SwarmSettings
from gateway.engine.generation import Engine, GenerationRequest
from gateway.engine.sampling import SamplingParams
from gateway.errors import BadRequest, TooManySessions
from local_remote import LocalRemote

MAX_SESSIONS, PER_CLIENT, CHOICES = 6, 4, 4


@pytest.fixture(scope="module")
def remote(tiny_llama):
    return LocalRemote(tiny_llama)


@pytest.fixture
def engine(tiny_llama, remote, tmp_path):
    limits = Limits(max_sessions=MAX_SESSIONS, max_sessions_per_client=PER_CLIENT, speculative_tokens=0)
    gateway = GatewaySettings(models=(ModelConfig("tiny", str(tiny_llama), max_session_length=64),), limits=limits)
    return Engine(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway), connect=lambda config: remote)


def choice_requests(prompt: list[int], count: int) -> list[GenerationRequest]:
    return [GenerationRequest(inputs=None, sampling=SamplingParams(do_sample=True, seed=seed), max_new_tokens=4,
                              input_ids=tuple(prompt) if seed == 0 else ()) for seed in range(count)]


def test_every_fork_of_n_choices_counts_under_both_caps_while_it_lives(engine):
    model = engine.model("tiny")
    prompt = model.encode("four choices for one prompt", at_start=True)
    session, cached = engine.open_for_prompt(model, prompt, 64, "key:a", choices=CHOICES)
    with engine.use_session(session.id):
        deltas = engine.generate_choices(session, choice_requests(prompt[cached:], CHOICES))
        _, first = next(deltas)  # the choices are decoding: the session and its three forks are open on the servers
        assert engine.sessions.held == CHOICES
        with pytest.raises(TooManySessions, match="MAX_SESSIONS_PER_CLIENT"):
            engine.open_for_prompt(model, prompt, 64, "key:a")  # the client is at its cap
        other, _ = engine.open_for_prompt(model, prompt, 64, "key:b")  # another client has room for one
        with pytest.raises(TooManySessions, match="MAX_SESSIONS"):  # a second would pass MAX_SESSIONS
            engine.open_for_prompt(model, prompt, 64, "key:b", choices=2)
        engine.finish_session(other)
        assert first.token_count + sum(delta.token_count for _, delta in deltas) == CHOICES * 4  # every choice's
    assert engine.sessions.held == 1  # the forks are closed and their slots given back; the session is the request's
    engine.finish_session(session)
    assert engine.sessions.held == 0


def test_choices_that_no_client_may_hold_are_refused_naming_n(engine):
    model = engine.model("tiny")
    with pytest.raises(BadRequest, match="MAX_SESSIONS_PER_CLIENT") as refused:
        engine.open_for_prompt(model, model.encode("too many", at_start=True), 64, "key:a", choices=PER_CLIENT + 1)
    assert refused.value.field == "n" and engine.sessions.held == 0


def test_forks_the_caps_have_no_room_for_are_refused_before_the_prompt_is_computed(engine):
    model = engine.model("tiny")
    prompt = model.encode("a prompt the caps refuse", at_start=True)
    session, _ = engine.open_for_prompt(model, prompt, 64, "key:a")
    holders = [engine.open_for_prompt(model, prompt, 64, "key:a")[0] for _ in range(PER_CLIENT - 2)]
    with engine.use_session(session.id), pytest.raises(TooManySessions):
        list(engine.generate_choices(session, choice_requests(prompt, 3)))  # two forks, room for one
    assert session.inference.sent == [] and not session.history  # nothing reached the servers
    for held in [session, *holders]:
        engine.finish_session(held)
    assert engine.sessions.held == 0
