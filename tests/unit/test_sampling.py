"""Every sampler against its definition: transformers' processors where they exist, else the formula by hand."""

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TypicalLogitsWarper

from gateway.engine.sampler import Sampler
from gateway.engine.sampling import (
    SamplingParams,
    apply_logit_bias,
    apply_presence_frequency,
    apply_repetition_penalty,
    filter_min_p,
    filter_top_k,
    filter_top_p,
    filter_typical,
    mirostat_v1_step,
    mirostat_v2_step,
)


def kept(filtered):
    """Indices a filter left (not -inf)."""
    return torch.nonzero(~torch.isneginf(filtered)).flatten().tolist()


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(1, 40)
    history = [3, 7, 7, 12, 39]
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([history]), logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, history, 1.3), expected)


def test_greedy_unless_sampling_is_asked_for():
    logits = torch.tensor([0.0, 5.0, 4.9])
    assert Sampler(SamplingParams(do_sample=False, temperature=2.0), 3)(logits) == 1
    assert Sampler(SamplingParams(repetition_penalty=2.0), 3, context=[1])(logits) == 2  # 5/2 < 4.9


def test_a_seed_makes_sampling_reproducible():
    logits = torch.randn(100)
    params = SamplingParams(do_sample=True, temperature=1.5, top_p=0.95, seed=11)
    draws = lambda: [sampler(logits) for sampler in [Sampler(params, 100)] for _ in range(8)]
    assert draws() == draws()
    assert len(set(draws())) > 1


# ---- filters on hand-made distributions -----------------------------------------------------------------------

PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])  # by rank: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)


def test_top_k_keeps_the_k_most_likely():
    assert kept(filter_top_k(PROBS.log(), 1)) == [1]
    assert kept(filter_top_k(PROBS.log(), 2)) == [1, 3]
    assert kept(filter_top_k(PROBS.log(), 3)) == [1, 2, 3]
    assert kept(filter_top_k(PROBS.log(), 0)) == [0, 1, 2, 3]  # off
    assert kept(filter_top_k(PROBS.log(), 10)) == [0, 1, 2, 3]


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    assert kept(filter_top_p(PROBS.log(), 0.5)) == [1]
    assert kept(filter_top_p(PROBS.log(), 0.79)) == [1, 3]
    assert kept(filter_top_p(PROBS.log(), 0.81)) == [1, 2, 3]
    assert kept(filter_top_p(PROBS.log(), 0.01)) == [1]  # never empty
    assert kept(filter_top_p(PROBS.log(), 1.0)) == [0, 1, 2, 3]  # off


def test_min_p_keeps_tokens_within_a_fraction_of_the_best():
    # threshold = min_p * 0.5
    assert kept(filter_min_p(PROBS.log(), 0.61)) == [1]  # 0.305 > 0.3
    assert kept(filter_min_p(PROBS.log(), 0.59)) == [1, 3]  # 0.295
    assert kept(filter_min_p(PROBS.log(), 0.29)) == [1, 2, 3]  # 0.145
    assert kept(filter_min_p(PROBS.log(), 0.09)) == [0, 1, 2, 3]  # 0.045
    assert kept(filter_min_p(PROBS.log(), 1.0)) == [1]
    assert torch.equal(filter_min_p(PROBS.log(), 0.0), PROBS.log())  # off


def test_filters_work_on_the_temperature_scaled_logits_and_keep_masked_tokens_out():
    logits = torch.tensor([2.0, 1.0, float("-inf"), 0.0])
    for filtered in [filter_top_k(logits, 4), filter_top_p(logits, 0.999), filter_min_p(logits, 1e-6),
                     filter_typical(logits, 0.999)]:
        assert torch.isneginf(filtered[2])


@pytest.mark.parametrize("mass", [0.1, 0.5, 0.9, 0.99])
def test_typical_matches_transformers(mass):
    torch.manual_seed(0)
    logits = torch.randn(6, 200) * 3
    logits[5, 10:60] = float("-inf")  # a constrained row as well
    expected = TypicalLogitsWarper(mass)(torch.zeros(6, 1, dtype=torch.long), logits.clone())
    actual = filter_typical(logits, mass)
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected))
    torch.testing.assert_close(actual, expected)
    assert 0 < int(torch.isneginf(actual[0]).sum()) < 200  # it does filter, and keeps something
    assert torch.equal(filter_typical(logits, 1.0), logits)  # off
    assert kept(filter_typical(logits[0], mass)) == kept(actual[0])  # one (vocab,) vector too


def test_typical_keeps_the_tokens_closest_to_the_entropy():
    # entropy = 1.505 nats; the likeliest token's surprise (0.916) is farther from it than the others' (1.897),
    # so typical sampling drops the token that top-p would keep first.
    logits = torch.tensor([0.4, 0.15, 0.15, 0.15, 0.15]).log()
    assert kept(filter_typical(logits, 0.5)) == [1, 2, 3, 4]
    assert kept(filter_typical(logits, 0.7)) == [0, 1, 2, 3, 4]
    assert 0 in kept(filter_top_p(logits, 0.5))


# ---- penalties, bias and the allowed mask ---------------------------------------------------------------------


def test_sampler_repetition_penalty_covers_context_and_output_like_transformers():
    torch.manual_seed(1)
    context, vocab = [4, 9, 9, 30], 32
    sampler = Sampler(SamplingParams(repetition_penalty=1.7), vocab, context)
    sequence = list(context)
    for step in range(5):
        logits = torch.randn(vocab) * 4
        expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([sequence]), logits[None].clone())[0]
        torch.testing.assert_close(sampler.processed_logits(logits), expected)
        sequence.append(sampler(logits, allowed=torch.arange(vocab) == step))  # force tokens 0, 1, 2, ...
    assert sequence[len(context):] == [0, 1, 2, 3, 4]


def test_presence_and_frequency_penalties_follow_openai_with_decay():
    vocab, presence, frequency = 8, 0.5, 0.3
    outputs = [2, 5, 2, 2, 7]
    for decay in [1.0, 0.8]:
        params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency, penalty_decay=decay)
        sampler = Sampler(params, vocab, context=[1, 3])  # the prompt's tokens are not counted
        counts = [0.0] * vocab
        for token in outputs:
            assert sampler(torch.zeros(vocab), allowed=torch.arange(vocab) == token) == token
            counts = [count * decay for count in counts]
            counts[token] += 1
            expected = [-(presence * (count > 0) + frequency * count) for count in counts]
            torch.testing.assert_close(sampler.processed_logits(torch.zeros(vocab)), torch.tensor(expected))
        assert counts[2] == pytest.approx(3.0 if decay == 1.0 else 0.8**4 + 0.8**2 + 0.8)  # steps 0, 2, 3 of 5


def test_apply_presence_frequency_is_the_formula():
    logits = torch.tensor([1.0, 2.0, 3.0, -1.0])
    counts = torch.tensor([0.0, 1.0, 2.5, 0.1])
    expected = torch.tensor([1.0, 2.0 - 0.4 - 1.0, 3.0 - 0.4 - 2.5, -1.0 - 0.4 - 0.1])
    torch.testing.assert_close(apply_presence_frequency(logits, counts, 0.4, 1.0), expected)


def test_logit_bias_forces_and_forbids_tokens():
    logits = torch.tensor([3.0, 1.0, -2.0, 0.5])
    assert Sampler(SamplingParams(), 4)(logits) == 0
    assert Sampler(SamplingParams(logit_bias=((2, 100.0),)), 4)(logits) == 2
    assert Sampler(SamplingParams(logit_bias={0: -1e9}), 4)(logits) == 1  # a dict works too
    hot = Sampler(SamplingParams(do_sample=True, temperature=100.0, logit_bias={0: -1e9, 3: float("-inf")}, seed=3), 4)
    draws = {hot(logits) for _ in range(300)}
    assert draws == {1, 2}
    torch.testing.assert_close(apply_logit_bias(logits, [(1, 2.0), (1, 0.5)]), torch.tensor([3.0, 3.5, -2.0, 0.5]))
    with pytest.raises(ValueError):
        apply_logit_bias(logits, [(4, 1.0)])
    assert hash(SamplingParams(logit_bias={1: 2.0})) == hash(SamplingParams(logit_bias=((1, 2.0),)))


@pytest.mark.parametrize("mirostat", [0, 1, 2])
def test_the_allowed_mask_is_always_respected(mirostat):
    torch.manual_seed(2)
    vocab = 300
    logits = torch.randn(vocab)
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[5, 77, 123]] = True
    logits[~allowed] += 20  # every disallowed token is far more likely
    params = SamplingParams(do_sample=True, temperature=50.0, mirostat=mirostat, seed=4)
    sampler = Sampler(params, vocab)
    assert {sampler(logits, allowed) for _ in range(200)} <= {5, 77, 123}
    assert Sampler(SamplingParams(), vocab)(logits, allowed) in {5, 77, 123}
    assert Sampler(params, vocab)(logits, allowed[:200]) in {5, 77, 123}  # a mask shorter than the LM head
    with pytest.raises(ValueError):
        Sampler(params, vocab)(logits, torch.zeros(vocab, dtype=torch.bool))


def test_filters_apply_in_order_top_k_before_top_p():
    # After top_k=2 the renormalised best token has 0.4 / 0.7 = 0.57 >= 0.5, so top_p keeps it alone;
    # top_p first on the raw distribution would keep tokens 0 and 1.
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    sampler = Sampler(SamplingParams(do_sample=True, top_k=2, top_p=0.5, seed=0), 4)
    assert {sampler(logits) for _ in range(100)} == {0}


# ---- Mirostat -------------------------------------------------------------------------------------------------


def test_mirostat_v2_truncates_by_surprise_and_updates_mu():
    torch.manual_seed(5)
    vocab, tau, eta, temperature = 64, 2.0, 0.3, 0.7
    logits = torch.randn(vocab) * 2
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=1, mirostat=2, mirostat_tau=tau,
                            mirostat_eta=eta, seed=6)
    sampler = Sampler(params, vocab)
    mu = 2 * tau
    assert sampler.mu == mu
    for _ in range(3):  # mu carries from step to step
        probs = torch.softmax(logits / temperature, -1)
        truncated = {j for j in range(vocab) if -math.log2(probs[j]) <= mu}
        assert 1 < len(truncated) < vocab  # the case is not trivial
        token = sampler(logits)
        assert token in truncated
        surprise = -math.log2(probs[token] / sum(probs[j] for j in truncated))
        mu = mu - eta * (surprise - tau)
        assert sampler.mu == pytest.approx(mu, abs=1e-5)
    # it replaces top_k: top_k=1 would allow only the argmax
    assert len({mirostat_v2_step(logits / temperature, 2 * tau, tau, eta)[0] for _ in range(100)}) > 1


def test_mirostat_v1_estimates_k_like_llama_cpp_and_updates_mu():
    torch.manual_seed(7)
    vocab, tau, eta, m = 300, 4.0, 0.5, 100
    ranks = (torch.randperm(vocab) + 1).float()
    # Zipf-like, but steeper past rank 80, so that s_hat (and then k) depends on using exactly the top m = 100
    logits = -ranks.log() - 0.3 * (ranks - 80).clamp(min=0) + 0.02 * torch.randn(vocab)
    sampler = Sampler(SamplingParams(do_sample=True, mirostat=1, mirostat_tau=tau, mirostat_eta=eta, seed=8), vocab)

    # llama.cpp's llama_sampler_mirostat_apply, transcribed
    probs = sorted(torch.softmax(logits, -1).tolist(), reverse=True)
    sum_ti_bi = sum_ti_sq = 0.0
    for i in range(min(m - 1, vocab - 1)):
        t_i = math.log((i + 2) / (i + 1))
        sum_ti_bi += t_i * math.log(probs[i] / probs[i + 1])
        sum_ti_sq += t_i * t_i
    s_hat = sum_ti_bi / sum_ti_sq
    epsilon_hat = s_hat - 1
    mu = 2 * tau
    k = max(int((epsilon_hat * 2**mu / (1 - vocab ** -epsilon_hat)) ** (1 / s_hat)), 1)
    assert 2 < k < vocab // 2  # the case is not trivial

    token = sampler(logits)
    rank = sorted(range(vocab), key=lambda j: -float(logits[j])).index(token)
    assert rank < k
    surprise = -math.log2(probs[rank] / sum(probs[:k]))
    assert sampler.mu == pytest.approx(mu - eta * (surprise - tau), abs=1e-5)
    # draws never leave the top k
    assert all(mirostat_v1_step(logits, mu, tau, eta, vocab)[0] in set(logits.argsort(descending=True)[:k].tolist())
               for _ in range(100))


# ---- seeds and greedy -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{}, {"top_k": 50, "typical_p": 0.95, "min_p": 0.01}, {"mirostat": 2}])
def test_seeded_sampling_is_reproducible_and_seeds_differ(extra):
    logits = torch.randn(100, generator=torch.Generator().manual_seed(9))
    run = lambda seed: [sampler(logits) for sampler in [Sampler(SamplingParams(do_sample=True, seed=seed, **extra),
                                                                100)] for _ in range(20)]
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_greedy_ignores_temperature_and_filters():
    logits = torch.tensor([1.0, 2.0, 0.5, 2.1, 1.9])
    for params in [SamplingParams(do_sample=False, temperature=100.0, top_p=0.1, min_p=0.9, seed=1),
                   SamplingParams(do_sample=False, temperature=0.01, mirostat=2),
                   SamplingParams(do_sample=True, temperature=0.0)]:
        sampler = Sampler(params, 5)
        assert [sampler(logits) for _ in range(30)] == [3] * 30
    hot = Sampler(SamplingParams(do_sample=True, temperature=100.0, seed=1), 5)
    assert len({hot(logits) for _ in range(30)}) > 1  # the same logits, sampled, do vary


def test_bad_parameters_are_refused():
    for bad in [{"top_p": 0.0}, {"temperature": -1.0}, {"mirostat": 3}, {"penalty_decay": 0.0}, {"min_p": 1.5},
                {"logit_bias": {-1: 1.0}}]:
        with pytest.raises(ValueError):
            SamplingParams(**bad)


@pytest.mark.parametrize("fields", [
    {"top_p": 5e-324},  # rounds to 0 in float32
    {"temperature": 1e-300},  # ditto; dividing by it would overflow
    {"temperature": 5e-324, "repetition_penalty": 1e-300},  # a penalty that sends logits to inf
    {"typical_p": 5e-324, "min_p": 1.0, "top_k": 1},
    {"mirostat": 2, "mirostat_tau": 5e-324, "mirostat_eta": 5e-324},
    {"mirostat": 1, "mirostat_tau": 1e300, "temperature": 1e-30},
    {"presence_penalty": 2, "frequency_penalty": -2, "penalty_decay": 5e-324},
    {"seed": 2**80}, {"seed": -1},  # any integer seeds (torch takes 64 bits)
])
def test_extreme_valid_parameters_still_choose_a_token(fields):
    """Whatever the APIs accept, the sampler turns into a token: never nan probabilities or a bad seed."""
    sampler = Sampler(SamplingParams(do_sample=True, **{"seed": 1, **fields}), 10, context=[1, 2])
    for _ in range(3):
        assert 0 <= sampler(torch.randn(10) * 50) < 10
