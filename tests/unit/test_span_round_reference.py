"""bench.span_round's reference: transformers' own decoder layers over a DynamicCache, which a span's round of one
row is measured against. It must compute what the span computes, or the ratio compares different work."""

import pytest
import torch

from bench.span_round import TransformersLayers, one_row_against_transformers, one_row_lines
from swarm.server.attention import Segment
from swarm.server.span import load_span
from tiny_model import build_tiny_model

PAST = 11


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", 4, perturb_vectors=True)


def test_the_reference_decodes_what_the_span_decodes(folder):
    torch.manual_seed(0)
    span = load_span(folder, 0, 4)
    reference = TransformersLayers(folder, "cpu", torch.float32, PAST)
    prompt = torch.randn(1, PAST, span.config.hidden_size)
    reference.cache.crop(-PAST)  # the same prompt in both caches
    reference.decode(prompt, 0)
    cache = span.new_cache(1, capacity=PAST + 1)
    span.forward_packed(prompt, [Segment(1, PAST, 0, cache)])
    step = torch.randn(1, 1, span.config.hidden_size)
    ours = span.forward_packed(step, [Segment(1, 1, PAST, cache)])
    torch.testing.assert_close(ours, reference.decode(step, PAST), atol=1e-4, rtol=0)
    assert reference.cache.get_seq_length() == PAST + 1
    reference.timed_round()  # a timed round leaves the cache as it found it: every round does the same work
    assert reference.cache.get_seq_length() == PAST + 1


def test_one_row_against_transformers_reports_both_medians_and_their_ratio(folder):
    span = load_span(folder, 0, 4)
    cache = span.new_cache(1, capacity=PAST + 1)
    span.forward_packed(torch.randn(1, PAST, span.config.hidden_size), [Segment(1, PAST, 0, cache)])
    found = one_row_against_transformers(span, folder, cache, PAST, (1, 3), min_seconds=0.0)
    assert found["repeats"] == 3 and found["position"] == PAST
    assert found["span_ms"] > 0 and found["transformers_ms"] > 0
    assert found["ratio"] == pytest.approx(found["span_ms"] / found["transformers_ms"])
    assert "tiny: span" in "\n".join(one_row_lines({"tiny": {"one_row_vs_transformers": found}}))


def test_the_decode_rounds_carry_the_reference_when_asked(folder):
    from bench.span_round import measure_decode_rounds

    rounds = measure_decode_rounds(folder, sessions=(1, 2), repeats=1, warmup=0, min_seconds=0.0, drafts=())
    assert rounds["one_row_vs_transformers"]["repeats"] == 1 and rounds["one_row_vs_transformers"]["ratio"] > 0
    without = measure_decode_rounds(folder, sessions=(1,), repeats=1, warmup=0, min_seconds=0.0, drafts=(),
                                    reference=False)
    assert "one_row_vs_transformers" not in without and set(without["ms_per_round"]) == {"1"}
