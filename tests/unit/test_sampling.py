import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from gateway.sampling import SamplingParams, apply_repetition_penalty, choose_token


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(1, 40)
    history = [3, 7, 7, 12, 39]
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([history]), logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, history, 1.3), expected)


def test_greedy_unless_sampling_is_asked_for():
    logits = torch.tensor([0.0, 5.0, 4.9])
    assert choose_token(logits, [], SamplingParams(do_sample=False, temperature=2.0), None) == 1
    assert choose_token(logits, [1], SamplingParams(repetition_penalty=2.0), None) == 2  # 5/2 < 4.9


def test_a_seed_makes_sampling_reproducible():
    logits = torch.randn(100)
    params = SamplingParams(do_sample=True, temperature=1.5, top_p=0.95, seed=11)
    draws = lambda: [choose_token(logits, [], params, generator) for generator in [params.generator()] for _ in range(8)]
    assert draws() == draws()
    assert len(set(draws())) > 1
