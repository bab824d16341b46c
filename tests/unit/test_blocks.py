"""A span of blocks, run in process, equals the same layers of the transformers model."""

import pytest
import torch
import transformers

from swarm.client.head import load_client
from swarm.families import FAMILIES
from swarm.server.span import load_span
from swarm.protocol import BadRequestError, UnknownModelError
from tiny_model import FAMILY_QUIRKS, build_tiny_model

FAMILY_OVERRIDES = {"mistral": {"sliding_window": 5}, "qwen2": {"perturb_vectors": True}, **FAMILY_QUIRKS}


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "bloom", "gpt2", *FAMILY_QUIRKS])
def family_model(request, tmp_path_factory):
    overrides = FAMILY_OVERRIDES.get(request.param, {})
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, 4, **overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    return folder, model


def hidden_states(model, ids):
    """transformers' hidden_states: [0] the first block's input, [i] block i-1's output, [-1] after the final norm."""
    with torch.no_grad():
        return model(ids, output_hidden_states=True).hidden_states


def layer_prefix(model, index: int) -> str:
    return FAMILIES[model.config.model_type].layer_key.format(index)


def test_span_matches_transformers(family_model):
    folder, model = family_model
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    states = hidden_states(model, ids)
    span = load_span(folder, 1, 3)
    torch.testing.assert_close(span(states[1]), states[3], atol=1e-5, rtol=0)


def test_cached_steps_match_a_whole_forward(family_model):
    folder, model = family_model
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    states = hidden_states(model, ids)
    span = load_span(folder, 0, 3)  # hidden_states[3] would include the final norm
    caches = span.new_cache(rows=2, capacity=16)
    outputs, position = [], 0
    for length in (5, 1, 1, 3, 1, 1):  # a prompt, decode steps, and a chunk in the middle
        outputs.append(span(states[0][:, position : position + length], position, caches))
        position += length
    torch.testing.assert_close(torch.cat(outputs, 1), states[3], atol=1e-4, rtol=1e-5)

    # rewinding overwrites the cache: re-running the last 4 positions gives the same outputs
    rerun = span(states[0][:, 8:], 8, caches)
    torch.testing.assert_close(rerun, states[3][:, 8:], atol=1e-4, rtol=1e-5)


def test_span_reads_only_its_blocks(family_model):
    folder, model = family_model
    span = load_span(folder, 1, 3)
    assert span.loaded_names and all(name.startswith((layer_prefix(model, 1), layer_prefix(model, 2)))
                                     for name in span.loaded_names)
    assert {name.split(".", 3)[2] for name in span.loaded_names} == {"1", "2"}


def test_client_half_matches_transformers(family_model):
    """Embeddings (with positions from any offset) and final norm + LM head equal transformers', and the
    client reads none of the blocks' tensors."""
    folder, model = family_model
    client = load_client(folder)
    assert client.loaded_names and not any(".h." in name or ".layers." in name for name in client.loaded_names)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    states = hidden_states(model, ids)
    torch.testing.assert_close(client.embed(ids), states[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat([client.embed(ids[:, :4]), client.embed(ids[:, 4:], position=4)], 1),
                               states[0], atol=1e-6, rtol=0)
    with torch.no_grad():
        output = model(ids, output_hidden_states=True)
    last_block = load_span(folder, 0, 4)(states[0])
    torch.testing.assert_close(client.logits(last_block), output.logits, atol=1e-4, rtol=0)


def test_sub_range_and_bad_ranges(family_model):
    folder, _ = family_model
    span = load_span(folder, 1, 3)
    hidden = torch.randn(1, 3, span.config.hidden_size)
    torch.testing.assert_close(span(hidden, start=1, end=3), span(hidden))
    with pytest.raises(BadRequestError, match="outside this server's span 1:3"):
        span(hidden, start=0, end=2)
    with pytest.raises(BadRequestError, match="out of range: this model has blocks 0:4"):
        load_span(folder, 2, 5)


def test_unsupported_family(tmp_path):
    config = transformers.AutoConfig.for_model("gpt_neo", num_layers=1, hidden_size=8, num_heads=2, vocab_size=10,
                                               attention_types=[[["global"], 1]])
    config.save_pretrained(tmp_path)
    with pytest.raises(UnknownModelError, match="'gpt_neo' is not supported"):
        load_span(tmp_path, 0, 1)


def test_moving_a_span_keeps_the_overlap_and_reads_only_new_blocks(family_model):
    folder, model = family_model
    old = load_span(folder, 0, 2)
    moved = load_span(folder, 1, 4, reuse=old)
    assert moved.layers[0] is old.layers[1]  # block 1 kept, not read again
    held = {int(name.split(".")[2]) for name in moved.loaded_names}
    assert held == {1, 2, 3}
    states = hidden_states(model, torch.randint(0, model.config.vocab_size, (1, 6)))
    torch.testing.assert_close(moved(states[1], start=1, end=3), states[3], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("quantization, max_error, max_size", [("int8", 0.1, 0.3), ("nf4", 0.6, 0.16)])
def test_quantized_spans_store_fewer_bytes_and_stay_close(family_model, quantization, max_error, max_size):
    folder, model = family_model
    if model.config.model_type == "gpt2":
        pytest.skip("GPT-2's projections are Conv1D, not nn.Linear: they stay unquantized")
    if model.config.model_type == "qwen3_moe":
        pytest.skip("Qwen3-MoE's experts are stacked 3-D parameters, not nn.Linear: they stay unquantized")
    reference, quantized = load_span(folder, 0, 2), load_span(folder, 0, 2, quantization=quantization)
    hidden = torch.randn(2, 7, model.config.hidden_size)
    expected, got = reference(hidden), quantized(hidden)
    assert got.dtype == torch.float32
    assert float((got - expected).norm() / expected.norm()) < max_error  # NF4 is coarse on uniform random weights
    assert quantized.weight_bytes() < max_size * reference.weight_bytes()
    assert quantized.quantization == quantization
