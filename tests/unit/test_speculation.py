"""Speculative decoding (gateway/engine/speculation.py): drafts verified in one step, the same replies."""

import json

import pytest
import torch

from config import GatewaySettings, Limits, ModelConfig, Settings, SwarmSettings
from gateway.engine.generation import Engine, GenerationRequest
from gateway.engine.grammar import GrammarSpec
from gateway.engine.sampler import Sampler
from gateway.engine.sampling import SamplingParams, apply_temperature
from gateway.engine.speculation import Pacing, StepCosts, prompt_lookup
from local_remote import LocalRemote

# code a reply goes on copying: prompt lookup's drafts are then right
PROMPT = ('{"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "known_for": ["Analytical Engine"]}\n'
          "The same JSON, pretty-printed:\n")


def test_prompt_lookup_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    assert prompt_lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # the latest of two occurrences
    assert prompt_lookup([5, 2, 3, 6, 4, 2, 3], 3) == [6, 4, 2]  # "2 3" occurred once before
    assert prompt_lookup([5, 6, 7, 5], 5) == [6, 7, 5]  # down to one token
    assert prompt_lookup([1, 2, 3, 4], 3) == [] and prompt_lookup([1, 2, 1], 0) == []


@pytest.mark.parametrize("value, message", [
    ("-1", "SPECULATIVE_TOKENS must be between 0 and 32, got -1"),
    ("33", "SPECULATIVE_TOKENS must be between 0 and 32, got 33"),
    ("many", "SPECULATIVE_TOKENS: expected int, got 'many'"),
])
def test_a_bad_speculative_tokens_setting_is_refused_naming_it(value, message):
    with pytest.raises(ValueError, match=message):
        GatewaySettings.from_env({"SPECULATIVE_TOKENS": value})


def test_the_speculation_settings_are_read_from_the_environment():
    settings = GatewaySettings.from_env({"SPECULATIVE_TOKENS": "0", "DRAFT_MODEL": "/models/small"})
    assert settings.limits.speculative_tokens == 0 and settings.default_model.draft_model == "/models/small"
    assert GatewaySettings.from_env({}).limits.speculative_tokens == 8


def test_pacing_drafts_long_when_steps_cost_their_round_trip_and_not_when_positions_cost_compute():
    wide_area, compute_bound = StepCosts(), StepCosts()
    for positions in (1, 5, 9) * 4:
        wide_area.observed(positions, 0.100 + 0.001 * positions)  # a round trip of 100 ms dominates
        compute_bound.observed(positions, 0.010 * positions)  # every position costs as much as a step
    right, wrong = Pacing(wide_area, 8), Pacing(compute_bound, 8)
    for _ in range(10):
        right.drafted(8, 8)
        wrong.drafted(8, 1)
    assert right.length() == 8 and right.acceptance > 0.8
    assert Pacing(compute_bound, 8).length() == 0 and wrong.length() == 0


def test_a_draft_must_promise_a_clear_gain():
    free_positions = WideAreaCosts()  # positions cost next to nothing: any right guess is a gain
    rarely_right, often_right = Pacing(free_positions, 1), Pacing(free_positions, 1)
    for _ in range(10):
        rarely_right.drafted(1, 0)
    often_right.drafted(1, 1)
    assert rarely_right.acceptance < 0.1 and rarely_right.length() == 0  # 1 + acceptance tokens: under 1.1x
    assert often_right.length() == 1


def test_a_sampled_guess_stands_with_its_probability_and_the_token_follows_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(do_sample=True, temperature=0.8, top_k=4, seed=7)
    target = torch.softmax(apply_temperature(logits, 0.8).masked_fill(torch.arange(6) >= 4, float("-inf")), dim=-1)
    draws = 4_000
    for guess in (0, 3, 5):  # likely, unlikely and filtered out by top_k
        sampler = Sampler(params, 6)
        results = [sampler.verify(logits, guess) for _ in range(draws)]
        counts = torch.bincount(torch.tensor([token for token, _ in results]), minlength=6)
        assert torch.allclose(counts / draws, target, atol=0.03), (guess, counts / draws, target)
        kept = sum(stood for _, stood in results) / draws
        assert abs(kept - float(target[guess])) < 0.03 and all(stood == (token == guess) for token, stood in results)
    greedy = Sampler(SamplingParams(), 6)
    assert greedy.verify(logits, 0) == (0, True) and greedy.verify(logits, 2) == (0, False)


@pytest.fixture(scope="module")
def remote(real_model):
    return LocalRemote(real_model)


def engine_of(remote, real_model, tmp_path, speculative_tokens: int, draft_model=None) -> Engine:
    served = ModelConfig("smol", str(real_model), max_session_length=512, draft_model=draft_model)
    gateway = GatewaySettings(models=(served,), limits=Limits(speculative_tokens=speculative_tokens))
    engine = Engine(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway), connect=lambda config: remote)
    engine.model("smol").step_costs = WideAreaCosts()
    return engine


class WideAreaCosts(StepCosts):
    """Steps priced as over a wide-area swarm, whatever this busy machine takes to compute them in process."""

    def line(self):
        return 0.100, 0.001  # a round trip of 100 ms, a millisecond per position


def reply(engine, request, session=None):
    session = session or engine.open_session("smol", 512, expires=False)
    with engine.sessions.use(session.id):
        deltas = list(engine.generate(session, request))
    return session, deltas


def request(count=32, **fields):
    sampling = fields.pop("sampling", SamplingParams())
    return GenerationRequest(inputs=fields.pop("inputs", PROMPT), sampling=sampling, max_new_tokens=count, **fields)


@pytest.mark.parametrize("fields", [
    {},  # greedy
    {"stop_sequences": ("field",)},
    {"logprobs": 2},
    {"sampling": SamplingParams(do_sample=True, temperature=0.7, seed=11)},  # seeded: the same draws
    {"sampling": SamplingParams(do_sample=True, mirostat=2, seed=5)},
])
def test_replies_with_speculation_equal_plain_decoding_in_fewer_steps(remote, real_model, tmp_path, fields):
    plain, drafted = engine_of(remote, real_model, tmp_path, 0), engine_of(remote, real_model, tmp_path, 8)
    _, expected = reply(plain, request(**dict(fields)))
    session, deltas = reply(drafted, request(**dict(fields)))
    steps = remote.sessions[-1].sent
    assert [(d.text, d.finish_reason) for d in deltas] == [(d.text, d.finish_reason) for d in expected]
    for got, want in zip(deltas, expected):
        for mine, theirs in zip(got.logprobs, want.logprobs):
            assert mine.token_id == theirs.token_id and abs(mine.logprob - theirs.logprob) < 1e-3
    tokens = sum(delta.token_count for delta in deltas)
    assert len(steps) < tokens - 4  # drafts were kept: fewer round trips than tokens
    assert max(len(step) for step in steps[1:]) > 1


def test_a_reply_ended_mid_step_goes_on_as_plain_decoding_does(remote, real_model, tmp_path):
    texts = []
    for speculative_tokens in (0, 8):
        engine = engine_of(remote, real_model, tmp_path, speculative_tokens)
        session, first = reply(engine, request(9))  # 9 tokens: a step of several ends past the budget
        _, second = reply(engine, request(12, inputs="\n# the same, once more:\n"), session)
        texts.append(["".join(d.text for d in deltas) for deltas in (first, second)])
        assert remote.sessions[-1].ids[: len(session.history)] == session.history
    assert texts[0] == texts[1]


def test_a_draft_model_guesses_where_prompt_lookup_cannot_and_the_reply_stays_the_same(remote, real_model, tmp_path):
    chat = request(24, inputs="Q: What is the capital of France?\nA:")
    _, expected = reply(engine_of(remote, real_model, tmp_path, 0), chat)
    # the served model as its own draft model: every guess is right, the reply comes 8 tokens and 1 per step
    _, deltas = reply(engine_of(remote, real_model, tmp_path, 8, draft_model=str(real_model)), chat)
    assert [d.text for d in deltas] == [d.text for d in expected]
    assert len(remote.sessions[-1].sent) <= 1 + 3


def test_a_draft_model_of_another_tokenizer_is_left_out_and_replies_go_on(remote, real_model, tiny_llama, tmp_path,
                                                                          caplog):
    engine = engine_of(remote, real_model, tmp_path, 8, draft_model=str(tiny_llama))
    _, deltas = reply(engine, request(4, inputs="Hello"))
    assert sum(d.token_count for d in deltas) == 4
    assert "has another tokenizer" in caplog.text and engine.draft_models.of(engine.model("smol")) is None


def test_a_structured_reply_drafts_within_its_grammar_and_equals_plain_decoding(remote, real_model, tmp_path):
    """The JSON schema's grammar checks every kept token; a draft is cut where the grammar would refuse it."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"}},
              "required": ["name", "born"]}
    replies = []
    for speculative_tokens in (0, 8):
        engine = engine_of(remote, real_model, tmp_path, speculative_tokens)
        grammars = engine.model("smol").grammars()
        structured = request(40, constraint=lambda: grammars.constraint(GrammarSpec("json_schema", schema)))
        replies.append("".join(d.text for d in reply(engine, structured)[1]))
        sent = remote.sessions[-1].sent
    assert replies[0] == replies[1] and json.loads(replies[1])["name"] == "Ada Lovelace"
    assert len(sent) < 30  # the name was copied from the prompt in drafts
