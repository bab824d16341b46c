"""The audits' fingerprint and judge (swarm/client/audit_judge.py) on the tiny model's span; bench.audits --quick."""

import json

import pytest
import torch

from swarm.client import audit_judge
from swarm.client.audit_judge import FINGERPRINT_DIMS, coarser, fingerprint, judge
from swarm.server.span import load_span


@pytest.fixture(scope="module")
def hop(tiny_llama):
    """Blocks 1:3 of the tiny model, their inputs (hidden states of a real forward through block 0, as a bfloat16
    hop sends them) and an honest float32 server's outputs, decoded one position at a time."""
    torch.manual_seed(0)
    span = load_span(tiny_llama, 1, 3)
    inputs = load_span(tiny_llama, 0, 1)(torch.randn(1, 48, 64)).to(torch.bfloat16)
    cache = span.new_cache(1, 48)
    decoded = torch.cat([span(inputs[:, position: position + 1], position, cache) for position in range(48)], 1)
    cache.release()
    return span, inputs, decoded[0]


def test_fingerprint_is_the_same_in_every_call_process_and_dtype():
    hidden = torch.randn(3, 5, 64)
    first = fingerprint(hidden)
    audit_judge.projection.cache_clear()
    assert first.dtype == torch.float32 and first.shape == (3, 5, FINGERPRINT_DIMS)
    assert torch.equal(fingerprint(hidden), first)
    # torch's CPU generator draws the same signs on every machine: the projection's first row, pinned
    assert (audit_judge.projection(64)[0] * 8).tolist() == [-1, -1, 1, -1, -1, -1, 1, -1, 1, -1, 1, 1, -1, -1, -1, -1]
    rounded = hidden.to(torch.bfloat16)
    assert torch.equal(fingerprint(rounded), fingerprint(rounded.float()))  # computed in float32 from any dtype
    assert not torch.equal(fingerprint(hidden, key=1), first)  # a client's secret key: another projection


def test_honest_bfloat16_prefill_agrees_with_float32_decode(tiny_llama, hop):
    _, inputs, decoded = hop
    recomputed = load_span(tiny_llama, 1, 3, dtype=torch.bfloat16)(inputs)[0]
    verdict = judge(fingerprint(decoded), fingerprint(recomputed), coarser("float32", "bfloat16"))
    assert verdict.honest, verdict.reason


def test_wrong_weights_and_a_skipped_block_are_caught(tiny_llama, hop):
    span, inputs, decoded = hop
    randomized = load_span(tiny_llama, 1, 3)
    with torch.no_grad():
        for parameter in randomized.parameters():
            if parameter.ndim >= 2:
                parameter.copy_(torch.randn_like(parameter) * parameter.std())
    skipped = span(inputs, start=1, end=2)[0]  # block 2 never ran
    for lie in (randomized(inputs)[0], skipped):
        verdict = judge(fingerprint(lie), fingerprint(decoded), "bfloat16")
        assert not verdict.honest and verdict.score > 1, verdict.reason


def test_noise_is_caught_where_the_servers_precision_makes_it_stand_out(hop):
    _, _, decoded = hop
    noise = torch.randn_like(decoded) * decoded.norm(dim=-1, keepdim=True) / decoded.shape[-1] ** 0.5
    claimed, honest = fingerprint(decoded + 1e-2 * noise), fingerprint(decoded)
    for precision in ("float32", "float16"):
        verdict = judge(claimed, honest, precision)
        assert not verdict.honest, verdict.reason
    # bfloat16 servers differ by about 1% at every position: noise of 1e-2 is within their honest spread
    assert judge(claimed, honest, "bfloat16").honest
    assert not judge(fingerprint(decoded + 1e-1 * noise), honest, "bfloat16").honest


def test_a_lie_on_one_percent_of_positions_is_caught():
    honest = torch.randn(400, 64) * 3
    claimed = honest.clone()
    claimed[[17, 123, 250, 399]] = torch.randn(4, 64) * 3  # 1% of the positions: random vectors of the same size
    verdict = judge(fingerprint(claimed), fingerprint(honest))
    assert not verdict.honest and verdict.reason.startswith("gross"), verdict.reason


def test_nan_and_shape_mismatch_are_dishonest():
    honest = fingerprint(torch.randn(10, 64))
    broken = honest.clone()
    broken[3, 0] = float("nan")
    assert not judge(broken, honest).honest
    assert not judge(honest, broken).honest  # a broken recomputation never vouches for anyone
    assert not judge(honest[:9], honest).honest
    assert not judge(honest[None], honest[None]).honest  # (T, DIMS) only
    assert judge(honest, honest).honest


def test_the_bench_runs_quickly(tmp_path):
    from bench import audits

    audits.main(["--quick", "--json", str(tmp_path / "audits.json")])
    figures = json.loads((tmp_path / "audits.json").read_text())
    assert figures["false_positives"]["false_positives"] == 0
    for attack in ("random weights", "nf4 weights", "block 2 skipped", "noise 0.1"):
        assert figures["attacks"][attack]["per_audit"]["bfloat16"]["64"] == 1.0, attack
    assert figures["costs"]["kept_bytes_per_token"] == 4 * FINGERPRINT_DIMS
