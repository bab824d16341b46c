import pytest
import torch

from swarm.client.decoding import IncrementalDetokenizer, filter_top_k, filter_top_p, next_token
from tiny_model import build_tokenizer


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]])
    assert next_token(logits).tolist() == [1, 0]


def test_top_k_keeps_k_best():
    filtered = filter_top_k(torch.tensor([[1.0, 4.0, 3.0, 2.0]]), 2)
    assert torch.isinf(filtered).tolist() == [[True, False, False, True]]


def test_top_p_keeps_the_smallest_nucleus():
    probabilities = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    filtered = filter_top_p(probabilities.log(), 0.8)
    assert torch.isinf(filtered).tolist() == [[False, False, True, True]]
    assert not torch.isinf(filter_top_p(probabilities.log(), 0.1)[0, 0])  # always at least one


def test_seeded_sampling_repeats():
    logits = torch.randn(1, 50)
    draw = lambda: [int(next_token(logits, 1.0, 0, 0.9, torch.Generator().manual_seed(7))) for _ in range(5)]
    assert draw() == draw()


@pytest.mark.parametrize("text", ["Hello, world! How are you?", "Привет, мир! 你好 🙂🚀 done"])
def test_detokenizer_streams_exactly_the_text(text):
    tokenizer = build_tokenizer()
    ids = tokenizer(text)["input_ids"]
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(token) for token in ids]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in piece for piece in pieces)


def test_top_p_below_what_float32_tells_from_zero_keeps_the_likeliest():
    logits = torch.tensor([[0.5, 2.0, -1.0]])
    assert (filter_top_p(logits, 1e-60) > float("-inf")).tolist() == [[False, True, False]]
