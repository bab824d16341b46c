"""logit_bias is paid once per request, not in the shared tick (issue 39, item 4): its entries are bounded as OpenAI
bounds them, and each request's bias is a row over the vocabulary made when its Sampler is, on the head's device."""

import pytest
import torch

from gateway.chat.params import logit_bias
from gateway.chat.schemas import MAX_LOGIT_BIAS, SamplingFields
from gateway.engine.sampler import Sampler, sample_rows
from gateway.engine.sampling import SamplingParams, apply_logit_bias
from gateway.errors import BadRequest
from gateway.web.bodies import parse

VOCAB, ROWS = 4096, 16


def full_biases(rows: int) -> list[SamplingParams]:
    """Each row biased on MAX_LOGIT_BIAS tokens of its own (the issue's worst case: no two rows share a bias)."""
    return [SamplingParams(logit_bias={(row * 7 + index * 13) % VOCAB: (index % 9) - 4.0
                                       for index in range(MAX_LOGIT_BIAS)}) for row in range(rows)]


@pytest.fixture
def tensors_made(monkeypatch) -> list[int]:
    """The size of every tensor made from Python values (torch.tensor) while the test runs."""
    sizes, make = [], torch.tensor

    def counted(data, *args, **kwargs):
        made = make(data, *args, **kwargs)
        sizes.append(made.numel())
        return made

    monkeypatch.setattr(torch, "tensor", counted)
    return sizes


def test_a_tick_builds_nothing_of_the_bias_from_python_values(tensors_made):
    samplers = [Sampler(params, VOCAB) for params in full_biases(ROWS)]
    assert all(sampler.bias is not None and sampler.bias.device == sampler.device for sampler in samplers)
    tensors_made.clear()  # what building the samplers (the request threads' part) made is not the tick's
    for _ in range(3):  # three ticks
        sample_rows(torch.randn(ROWS, VOCAB), samplers, [None] * ROWS)
    assert max(tensors_made, default=0) <= ROWS  # at most a row index per row: never the bias's entries


def test_the_bias_made_once_moves_each_row_as_the_pairs_do():
    params = full_biases(ROWS)
    logits = torch.randn(ROWS, VOCAB)
    tokens = sample_rows(logits.clone(), [Sampler(row, VOCAB) for row in params], [None] * ROWS).tolist()
    expected = [int(apply_logit_bias(logits[row], params[row].logit_bias).argmax()) for row in range(ROWS)]
    assert tokens == expected


def test_a_bias_on_a_longer_head_than_the_vocabulary_still_applies():
    sampler = Sampler(SamplingParams(logit_bias={3: 100.0}), 8)
    assert sampler(torch.zeros(12)) == 3  # logits padded past the tokenizer's vocabulary


@pytest.mark.parametrize("name", ["logit_bias", "bias"])
def test_more_entries_than_openai_allows_are_a_400_naming_the_field(name):
    with pytest.raises(BadRequest, match=name) as refused:
        parse(SamplingFields, {name: {str(token): 1.0 for token in range(MAX_LOGIT_BIAS + 1)}})
    assert refused.value.field == name
    assert parse(SamplingFields, {name: {str(token): 1.0 for token in range(MAX_LOGIT_BIAS)}})


def test_both_names_together_are_bounded_as_one():
    fields = SamplingFields(logit_bias={token: 1.0 for token in range(200)},
                            bias={token: 1.0 for token in range(200, 400)})
    with pytest.raises(BadRequest, match=f"at most {MAX_LOGIT_BIAS}") as refused:
        logit_bias(fields, VOCAB)
    assert refused.value.field == "logit_bias"
