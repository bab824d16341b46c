"""LoRA adapters on a block span (swarm/server/adapters.py), in process: one packed round of sessions of two
adapters and of none equals, token for token, transformers + peft run separately per adapter; the folders a
server must refuse at start-up; and the records that announce adapters."""

import json

import pytest
import torch

from swarm.protocol import ServerInfo, ServerState
from swarm.server.adapters import AdaptedLinear, AdapterError, attach_adapters, read_adapter
from swarm.server.attention import Segment
from swarm.server.span import load_span
from tiny_model import build_lora_adapter, build_tiny_model

ATOL = 1e-4
BLOCKS = 3
SPAN_END = 2  # the span holds blocks 0:2 of 3: an adapter's tensors of block 2 are another server's


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = build_tiny_model(tmp_path_factory.mktemp("base"), "llama", BLOCKS, seed=3)
    adapters = tmp_path_factory.mktemp("adapters")
    first = build_lora_adapter(base, adapters / "ad-attn", ["q_proj", "v_proj"], rank=4, alpha=8, seed=1)
    second = build_lora_adapter(base, adapters / "ad-mlp", ["o_proj", "gate_proj", "down_proj"], rank=8, alpha=4,
                                seed=2, use_rslora=True)
    return base, first, second


@pytest.fixture(scope="module")
def span(folders):
    base, first, second = folders
    span = load_span(base, 0, SPAN_END)
    attach_adapters(span, [read_adapter(first), read_adapter(second)])
    return span


@pytest.fixture(scope="module")
def peft_model(folders):
    """The local reference: transformers + peft, both adapters loaded, one active at a time."""
    import peft
    import transformers

    base, first, second = folders
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, first, adapter_name="ad-attn")
    model.load_adapter(second, adapter_name="ad-mlp")
    return model.eval()


def reference_hidden(peft_model, ids: torch.Tensor, adapter) -> torch.Tensor:
    """Hidden states after block SPAN_END - 1 of the local model through `adapter` (None: the base model)."""
    with torch.no_grad():
        if adapter is None:
            with peft_model.disable_adapter():
                return peft_model(ids, output_hidden_states=True).hidden_states[SPAN_END]
        peft_model.set_adapter(adapter)
        return peft_model(ids, output_hidden_states=True).hidden_states[SPAN_END]


def embeddings(peft_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return peft_model.get_input_embeddings()(ids)


def test_one_round_of_two_adapters_and_none_equals_separate_local_runs(span, peft_model):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, peft_model.config.vocab_size, (3, 6), generator=generator)
    adapters = ["ad-attn", None, "ad-mlp"]
    caches = [span.new_cache(1, 16) for _ in adapters]
    for cache in caches:
        cache.prepare(0, 6)
    hidden = embeddings(peft_model, ids)
    segments = [Segment(1, 6, 0, cache, adapter) for cache, adapter in zip(caches, adapters)]
    packed = span.forward_packed(hidden.reshape(1, -1, hidden.shape[-1]), segments)[0].view(3, 6, -1)
    for row, adapter in enumerate(adapters):
        expected = reference_hidden(peft_model, ids[row : row + 1], adapter)[0]
        torch.testing.assert_close(packed[row], expected, atol=ATOL, rtol=0)
    # the adapters change the outputs: the comparison above could not pass with the base model alone
    base = reference_hidden(peft_model, ids[0:1], None)[0]
    assert not torch.allclose(packed[0], base, atol=1e-2)

    # then one decode round of the three sessions, each through its own adapter (or none), from their caches
    extended = torch.cat([ids, torch.randint(3, peft_model.config.vocab_size, (3, 1), generator=generator)], 1)
    for cache in caches:
        cache.prepare(6, 7)
    step = embeddings(peft_model, extended[:, 6:]).reshape(1, 3, -1)
    decoded = span.forward_packed(step, [Segment(1, 1, 6, cache, adapter) for cache, adapter in zip(caches, adapters)])
    for row, adapter in enumerate(adapters):
        expected = reference_hidden(peft_model, extended[row : row + 1], adapter)[0, -1]
        torch.testing.assert_close(decoded[0, row], expected, atol=ATOL, rtol=0)


def test_adapters_wrap_only_the_modules_they_target(span):
    attention, mlp = span.layers[0].self_attn, span.layers[0].mlp
    assert set(attention.q_proj.deltas) == {"ad-attn"} and set(attention.o_proj.deltas) == {"ad-mlp"}
    assert set(mlp.down_proj.deltas) == {"ad-mlp"}
    assert not isinstance(attention.k_proj, AdaptedLinear) and not isinstance(mlp.up_proj, AdaptedLinear)
    assert span.adapters == {"ad-attn", "ad-mlp"}


def test_a_span_moved_over_kept_layers_is_adapted_once(folders, span):
    base, first, _ = folders
    moved = load_span(base, 1, BLOCKS, reuse=span)  # block 1 kept (already adapted), block 2 read
    attach_adapters(moved, [read_adapter(first)])
    assert isinstance(moved.layers[0].self_attn.q_proj.base, torch.nn.Linear)  # not wrapped twice
    assert set(moved.layers[1].self_attn.q_proj.deltas) == {"ad-attn"}


def test_an_unknown_adapter_in_a_round_is_refused(span):
    from swarm.protocol import BadRequestError

    with pytest.raises(BadRequestError, match="no adapter 'nope'"):
        span.forward_packed(torch.zeros(1, 2, span.config.hidden_size), [Segment(1, 2, 0, None, "nope")])


def _edited_copy(source, destination, **config_changes):
    import shutil

    shutil.copytree(source, destination)
    config = json.loads((destination / "adapter_config.json").read_text())
    (destination / "adapter_config.json").write_text(json.dumps({**config, **config_changes}))
    return destination


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "peft_type"),
])
def test_adapters_the_server_cannot_apply_are_refused_at_start_up(folders, tmp_path, change, message):
    folder = _edited_copy(folders[1], tmp_path / "changed", **change)
    with pytest.raises(AdapterError, match=message):
        read_adapter(folder)


def test_an_adapter_of_another_model_is_refused(tmp_path, span):
    other = build_tiny_model(tmp_path / "wide", "llama", BLOCKS, hidden_size=96, num_attention_heads=4)
    adapter = build_lora_adapter(other, tmp_path / "wide-lora", ["q_proj"])
    with pytest.raises(AdapterError, match="another model"):
        attach_adapters(span, [read_adapter(adapter)])


def test_a_folder_without_an_adapter_or_with_a_bad_name_is_refused(tmp_path, folders):
    with pytest.raises(AdapterError, match="adapter_config.json"):
        read_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text("[]")
    with pytest.raises(AdapterError, match="not a JSON object"):
        read_adapter(tmp_path)
    with pytest.raises(AdapterError, match="name"):
        read_adapter(_edited_copy(folders[1], tmp_path / "with space"))


def test_records_announce_adapters_and_ignore_malformed_lists():
    info = ServerInfo(ServerState.ONLINE, 0, 2, 10.0, 100, adapters=("ad-attn", "ad-mlp"))
    assert ServerInfo.from_wire(info.to_wire()) == info
    assert "adapters" not in ServerInfo(ServerState.ONLINE, 0, 2, 10.0, 100).to_wire()  # as older servers wrote it
    for malformed in (["a:b"], "ad-attn", [1], ["x"] * 1000):
        assert ServerInfo.from_wire({**info.to_wire(), "adapters": malformed}) is None


def test_rank_and_alpha_patterns_scale_as_peft_does(folders, tmp_path):
    import peft
    import transformers

    base = folders[0]
    patterned = build_lora_adapter(base, tmp_path / "ad-patterned", ["q_proj", "v_proj"], rank=4, alpha=8,
                                   rank_pattern={"q_proj": 2}, alpha_pattern={"v_proj": 32})
    span = load_span(base, 0, SPAN_END)
    attach_adapters(span, [read_adapter(patterned)])
    assert span.layers[0].self_attn.q_proj.deltas["ad-patterned"].down.shape[0] == 2
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), patterned).eval()
    ids = torch.randint(3, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = model(input_ids=ids, output_hidden_states=True).hidden_states[SPAN_END][0]
        hidden = model.get_input_embeddings()(ids)
    output = span.forward_packed(hidden, [Segment(1, 5, 0, None, "ad-patterned")])[0]
    torch.testing.assert_close(output, expected, atol=ATOL, rtol=0)


def test_decode_rounds_with_an_adapter_run_eagerly_not_as_graphs(folders):
    base, first, _ = folders
    span = load_span(base, 0, SPAN_END)
    attach_adapters(span, [read_adapter(first)])
    span.new_pool(256)
    span.use_graphs(capture=False)  # the graphs' padded rounds, run eagerly: how a CPU checks that path
    cache = span.new_cache(1, 16)
    span.forward_packed(torch.randn(1, 4, span.config.hidden_size), [Segment(1, 4, 0, cache)])
    step = torch.randn(1, 1, span.config.hidden_size)
    assert span.graphs.replay(step, [Segment(1, 1, 4, cache, "ad-attn")], 0, SPAN_END) is None
    assert span.graphs.replay(step, [Segment(1, 1, 4, cache)], 0, SPAN_END) is not None


def test_a_round_issues_as_many_torch_ops_for_two_adapters_as_for_one(span):
    """Every adapter's delta is computed at once (stacked matrices): an adapted module issues the same operators
    whatever the number of adapters in the round; only the round's map of tokens to adapters grows, by one
    operator per adapter (not per module: the span has dozens of adapted modules)."""
    from op_counts import count_torch_ops

    def decode_round(adapters: list) -> int:
        caches = [span.new_cache(1, 16) for _ in adapters]
        for cache in caches:
            span(torch.randn(1, 3, span.config.hidden_size), 0, cache)
            cache.prepare(3, 4)
        hidden = torch.randn(1, len(adapters), span.config.hidden_size)
        segments = [Segment(1, 1, 3, cache, adapter) for cache, adapter in zip(caches, adapters)]
        try:
            return count_torch_ops(lambda: span.forward_packed(hidden, segments))
        finally:
            for cache in caches:
                cache.release()

    adapted_modules = sum(isinstance(module, AdaptedLinear) for module in span.modules())
    one, two = decode_round(["ad-attn", "ad-attn"]), decode_round(["ad-attn", "ad-mlp"])
    assert adapted_modules >= 10 and 0 <= two - one <= 3
