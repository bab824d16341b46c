"""The newer families' quirks, in process: each registry part is needed (the tiny models' configs exercise it:
with the part swapped for the plain one, the span no longer equals transformers), soft-capped attention equals
transformers' eager one, rounds of several sessions (and the decode-graph path) equal the sessions alone, a MoE
layer's experts run once per round on all its tokens, and bfloat16 spans stay close. The exact match through
real servers is tests/integration/test_families.py; test_blocks.py checks spans and the client half per family."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from swarm import families
from swarm.families import FAMILIES, family_of
from swarm.families.decoder import no_qk_norm, no_softcap, pre_norm_residuals, rotate_whole_heads
from swarm.families.experts import stacked_experts
from swarm.families.family import no_window, uncapped, unscaled
from swarm.client.head import load_client
from swarm.protocol import UnknownModelError
from swarm.server.attention import Segment, softcapped_attention
from swarm.server.span import load_span
from tiny_model import FAMILY_QUIRKS, build_tiny_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def folder_of(tmp_path_factory):
    """model_type -> the folder of its tiny model with FAMILY_QUIRKS' config, built on first use."""
    folders = {}

    def folder(model_type: str):
        if model_type not in folders:
            folders[model_type] = build_tiny_model(tmp_path_factory.mktemp(model_type), model_type, 4, seed=7,
                                                   **FAMILY_QUIRKS[model_type])
        return folders[model_type]

    return folder


def swarm_logits(folder, ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The client's and a span's halves, as a session computes them: a prompt of 5 tokens, then one at a time."""
    span, client = load_span(folder, 0, 4, dtype=dtype), load_client(folder, dtype=dtype)
    cache = span.new_cache(ids.shape[0], ids.shape[1])
    outputs = [span(client.embed(ids[:, :5]), 0, cache)]
    outputs += [span(client.embed(ids[:, position : position + 1], position), position, cache)
                for position in range(5, ids.shape[1])]
    return client.logits(torch.cat(outputs, 1))


def local_logits(folder, ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return model(ids).logits.float()


def prompt(vocab: int = 200, rows: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(5))


def full_base_for_every_layer(rotary, hidden, batch) -> None:
    """Gemma 3 without its local rotary base: every layer type rotates with the full-attention layers' base."""
    pair = rotary(hidden, batch.positions[None, :], "full_attention")
    for layer_type in set(rotary.config.layer_types):
        batch.rotary[layer_type] = pair


def without(model_type: str, layer: dict | None = None, client: dict | None = None, **family):
    family_entry = FAMILIES[model_type]
    changes = dict(family)
    if layer:
        changes["layer_forward"] = dataclasses.replace(family_entry.layer_forward, **layer)
    if client:
        changes["client"] = dataclasses.replace(family_entry.client, **client)
    return dataclasses.replace(family_entry, **changes)


QUIRKS = {  # (family, the quirk) -> the family's entry with that part swapped for the plain one
    ("qwen3", "QK-norm"): without("qwen3", layer=dict(normalize_qk=no_qk_norm)),
    ("qwen3", "sliding layers"): without("qwen3", sliding_window=no_window),
    ("qwen3_moe", "QK-norm"): without("qwen3_moe", layer=dict(normalize_qk=no_qk_norm)),
    ("qwen3_moe", "sliding window"): without("qwen3_moe", sliding_window=no_window),
    ("phi3", "partial rotary"): without("phi3", layer=dict(rotate=rotate_whole_heads)),
    ("phi3", "sliding window"): without("phi3", sliding_window=no_window),
    ("gemma2", "attention soft-capping"): without("gemma2", layer=dict(softcap=no_softcap)),
    ("gemma2", "norms around attention and MLP"): without("gemma2", layer=dict(residuals=pre_norm_residuals)),
    ("gemma2", "sliding layers"): without("gemma2", sliding_window=no_window),
    ("gemma2", "scaled embeddings"): without("gemma2", client=dict(embed_scale=unscaled)),
    ("gemma2", "final soft-capping"): without("gemma2", client=dict(logit_softcap=uncapped)),
    ("gemma3_text", "QK-norm"): without("gemma3_text", layer=dict(normalize_qk=no_qk_norm)),
    ("gemma3_text", "local rotary base"): without("gemma3_text", batch_inputs=full_base_for_every_layer),
    ("gemma3_text", "sliding layers"): without("gemma3_text", sliding_window=no_window),
    ("gemma3_text", "scaled embeddings"): without("gemma3_text", client=dict(embed_scale=unscaled)),
    ("gemma3_text", "final soft-capping"): without("gemma3_text", client=dict(logit_softcap=uncapped)),
}


@pytest.mark.parametrize("model_type, quirk", list(QUIRKS), ids=[" ".join(key) for key in QUIRKS])
def test_every_quirk_is_in_the_registry_and_needed(model_type, quirk, folder_of, monkeypatch):
    folder = folder_of(model_type)
    ids = prompt()
    expected = local_logits(folder, ids)
    torch.testing.assert_close(swarm_logits(folder, ids), expected, atol=ATOL, rtol=0)
    monkeypatch.setitem(families.FAMILIES, model_type, QUIRKS[(model_type, quirk)])
    try:
        off_by = float((swarm_logits(folder, ids) - expected).abs().max())
    except RuntimeError:  # a head of 16 dimensions does not take Phi-3's cos/sin of 8 whole
        off_by = float("inf")
    assert off_by > 100 * ATOL, f"{model_type} without its {quirk} still equals transformers"


def test_softcapped_attention_equals_transformers_eager():
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    generator = torch.Generator().manual_seed(0)
    queries, keys, values = (torch.randn(3, heads, length, 8, generator=generator)
                             for heads, length in ((6, 5), (2, 7), (2, 7)))
    visible = torch.rand(3, 1, 5, 7, generator=generator) > 0.3
    visible[..., 0] = True  # every query sees a key
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 3, False
    additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    expected, _ = eager_attention_forward(module, queries, keys, values, additive, scaling=0.3, softcap=2.0)
    got = softcapped_attention(queries, keys, values, attn_mask=visible, scale=0.3, softcap=2.0)
    torch.testing.assert_close(got.transpose(1, 2), expected, atol=1e-6, rtol=0)


def packed_round_equals_sessions_alone(span, graphs: bool) -> None:
    """Three sessions cached at different lengths, then one round of a decode step of each and (without graphs)
    a prefill chunk and a cache-less forward beside them: every output equals its session's own step."""
    hidden_size, lengths = span.config.hidden_size, (3, 6, 9)
    caches = [span.new_cache(1, 16) for _ in lengths]
    for cache, length in zip(caches, lengths):
        span(torch.randn(1, length, hidden_size), 0, cache)
    steps = [torch.randn(1, 1, hidden_size) for _ in lengths]
    alone = [span(step, length, cache) for step, length, cache in zip(steps, lengths, caches)]  # rewritten below
    segments = [Segment(1, 1, length, cache) for length, cache in zip(lengths, caches)]
    inputs = list(steps)
    if not graphs:
        chunk = torch.randn(1, 4, hidden_size)
        alone.append(span(chunk, 0, None))
        segments.append(Segment(1, 4, 0, None))
        inputs.append(chunk)
    if graphs:
        span.use_graphs(capture=False)
    packed = span.forward_packed(torch.cat(inputs, 1), segments)
    torch.testing.assert_close(packed, torch.cat(alone, 1), atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "qwen3_moe"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graph path"])
def test_a_round_of_several_sessions_equals_each_alone(model_type, graphs, folder_of):
    span = load_span(folder_of(model_type), 0, 4)
    span.new_pool(1024)
    packed_round_equals_sessions_alone(span, graphs)


def test_a_mixture_of_experts_layer_runs_its_experts_once_per_round(folder_of):
    """Qwen3-MoE: the sparse block is called once per layer per round with every packed token, and its experts
    run transformers' batched implementation, never a loop per token."""
    span = load_span(folder_of("qwen3_moe"), 0, 4)
    calls = []
    for layer in span.layers:
        layer.mlp.register_forward_hook(lambda module, args, output: calls.append((type(module).__name__,
                                                                                 args[0].shape[1])))
    segments = [Segment(1, 5, 0, None), Segment(2, 3, 0, None)]
    span.forward_packed(torch.randn(1, 11, span.config.hidden_size), segments)
    assert calls == [("Qwen3MoeSparseMoeBlock", 11)] * 3 + [("Qwen3MoeMLP", 11)]  # block 3: mlp_only_layers
    assert {layer.mlp.experts.config._experts_implementation for layer in span.layers[:3]} == {"grouped_mm"}


@pytest.mark.parametrize("model_type", list(FAMILY_QUIRKS))
def test_bfloat16_spans_and_clients_stay_close_to_transformers_in_bfloat16(model_type, folder_of):
    folder, ids = folder_of(model_type), prompt()
    expected = local_logits(folder, ids, torch.bfloat16)
    got = swarm_logits(folder, ids, torch.bfloat16)
    assert float((got - expected).abs().max()) < 0.25  # a few bfloat16 steps at logits of up to ~8
    assert float((got.argmax(-1) == expected.argmax(-1)).float().mean()) > 0.9


def test_experts_are_stacked_from_the_checkpoints_per_expert_tensors():
    gate, up, down = (torch.randn(2, 3, 4) for _ in range(3))
    state = {"mlp.gate.weight": torch.ones(2, 4)}
    for expert in (1, 0):  # any order in the checkpoint
        state |= {f"mlp.experts.{expert}.gate_proj.weight": gate[expert],
                  f"mlp.experts.{expert}.up_proj.weight": up[expert],
                  f"mlp.experts.{expert}.down_proj.weight": down[expert]}
    stacked = stacked_experts(state)
    assert set(stacked) == {"mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    torch.testing.assert_close(stacked["mlp.experts.gate_up_proj"], torch.cat([gate, up], 1))
    torch.testing.assert_close(stacked["mlp.experts.down_proj"], down)
    assert stacked_experts({"mlp.gate.weight": state["mlp.gate.weight"]}).keys() == {"mlp.gate.weight"}


def test_an_embedding_gemma_is_refused_by_name():
    config = transformers.AutoConfig.for_model("gemma3_text", use_bidirectional_attention=True)
    with pytest.raises(UnknownModelError, match="use_bidirectional_attention"):
        family_of(config)
