"""A server sized for its box: how many blocks its memory fits (swarm/server/sizing.py), counted without loading a
weight and against what load_span and the page pool really take; and the flags of a server behind a forwarded port
(--public-address, --announce-maddrs). A real server of each: tests/integration/test_sized_server.py."""

import pytest
import torch

from swarm.protocol import BadRequestError
from swarm.server.sizing import GIB, block_weight_bytes, cache_bytes_per_block, fit_blocks, memory_budget
from tiny_model import build_tiny_model

PEERS = ["--initial-peers", "/ip4/203.0.113.7/tcp/31337/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"]

# hidden 64, MLP 128, 4 heads of 16, 2 KV heads: per block q 64x64, k and v 64x32, o 64x64, gate and up 64x128,
# down 128x64 (36,864 linear weights in 512 output rows) and two norms of 64
LINEAR_WEIGHTS, OUTPUT_ROWS, NORM_WEIGHTS = 36864, 512, 128
BLOCK_PARAMETERS = LINEAR_WEIGHTS + NORM_WEIGHTS  # 36,992


def tiny_config(layers: int = 4):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512)


def test_a_block_counted_by_hand():
    config = tiny_config()
    # 1024 cache tokens: 64 pages of 16, plus the zero and scratch pages; keys and values of 2 heads of 16
    cache = 2 * (64 + 2) * 16 * 2 * 16 * 4
    assert cache_bytes_per_block(2, 16, 1024, torch.float32) == cache == 270336
    weights = BLOCK_PARAMETERS * 4
    # a round of 32 tokens: 36,992 / 64 = 578 values a token, in float32; and the cache of one block gathered
    working = 32 * 578 * 4 + cache
    per_block = weights + cache
    fit = fit_blocks(config, torch.float32, None, 1024, 32, working + 3 * per_block + per_block // 2, "test")
    assert (fit.weight_bytes, fit.cache_bytes, fit.working_bytes) == (weights, cache, working)
    assert (fit.fits, fit.holds) == (3, 3)
    fit = fit_blocks(config, torch.float32, None, 1024, 32, working + 3 * per_block, "test")
    assert fit.fits == 3  # exactly three fit
    fit = fit_blocks(config, torch.float32, None, 1024, 32, working + 3 * per_block - 1, "test")
    assert fit.fits == 2
    # never more than the model has; CUDA graphs keep a round's working memory of their own
    fit = fit_blocks(config, torch.float32, None, 1024, 32, 2 * working + 9 * per_block, "test", graphs=True)
    assert (fit.working_bytes, fit.fits, fit.holds) == (2 * working, 9, 4)
    assert "holds 4 blocks: 9 fit its memory (test, " in fit.describe()
    half = fit_blocks(config, torch.bfloat16, None, 1024, 32, GIB, "test")
    assert (half.weight_bytes, half.cache_bytes) == (weights // 2, cache // 2)


def test_quantized_blocks_counted_in_bitsandbytes_formats():
    with torch.device("meta"):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        layer = LlamaDecoderLayer(tiny_config(), 0)
    norms = NORM_WEIGHTS * 4  # float32: only nn.Linear weights are quantized
    # int8: a byte a weight, and a float32 scale per output row
    assert block_weight_bytes(layer, torch.float32, "int8") == LINEAR_WEIGHTS + OUTPUT_ROWS * 4 + norms
    # nf4: half a byte a weight, a uint8 absmax per 64 weights, a float32 absmax per 256 of those
    assert block_weight_bytes(layer, torch.float32, "nf4") == LINEAR_WEIGHTS // 2 + LINEAR_WEIGHTS // 64 + 9 + norms


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "bloom", "gpt2"])
def test_the_count_is_what_a_loaded_span_and_its_pool_take(tmp_path, model_type):
    """Counted on the meta device, equal to the real thing, in families whose caches are shaped each their own way
    (GPT-2's projections are Conv1D); Qwen3-MoE's last block is a dense MLP, smaller than its expert blocks: the
    largest block is counted."""
    from swarm.server.span import load_span
    from swarm.weights import load_config

    folder = build_tiny_model(tmp_path, model_type, 4)
    for dtype in (torch.float32, torch.bfloat16):
        span = load_span(folder, 0, 4, dtype=dtype)
        fit = fit_blocks(load_config(folder), dtype, None, 1024, 32, GIB, "test")
        layer_bytes = [sum(tensor.numel() * tensor.element_size() for tensor in [*layer.parameters(), *layer.buffers()])
                       for layer in span.layers]
        assert fit.weight_bytes == max(layer_bytes)
        assert len(set(layer_bytes)) == (2 if model_type == "qwen3_moe" else 1)
        pool = span.new_pool(1024)
        assert 4 * fit.cache_bytes == 2 * pool.keys.numel() * pool.keys.element_size()


def test_not_even_one_block_is_a_clear_error():
    with pytest.raises(BadRequestError) as raised:
        fit_blocks(tiny_config(), torch.float32, None, 1024, 32, 500_000, "--memory-budget")
    message = str(raised.value)
    needed = BLOCK_PARAMETERS * 4 + 2 * 270336 + 32 * 578 * 4
    assert f"not even one block of this model fits in memory: one needs {needed} bytes" in message
    assert "500000 bytes are available (--memory-budget, 488.28 KiB)" in message and "--cache-tokens 1024" in message


def test_the_budget_is_the_flags_else_the_available_ram(monkeypatch):
    import psutil

    assert memory_budget(torch.device("cpu"), 0.75) == (3 * GIB // 4, "--memory-budget")

    class Memory:
        available = 12345678

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory())
    assert memory_budget(torch.device("cpu"), None) == (12345678, "available RAM")


def test_the_sizing_flags(capsys):
    from swarm.server.settings import parse_settings

    sized = parse_settings([*PEERS, "--memory-budget", "2.5"])
    assert (sized.blocks, sized.num_blocks, sized.memory_budget) == (None, None, 2.5)
    assert sized.rebalance_period > 0  # it chose its span: it may move as --num-blocks does
    assert parse_settings(PEERS).memory_budget is None  # sized to what is free
    for value in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            parse_settings([*PEERS, "--memory-budget", value])
        assert "--memory-budget must be a positive, finite number of GiB" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings([*PEERS, "--num-blocks", "2", "--memory-budget", "1"])
    assert "give it without --blocks or --num-blocks" in capsys.readouterr().err


def test_the_public_address_flags(capsys):
    from swarm.server.settings import parse_settings

    def announced(*flags):
        return parse_settings([*PEERS, "--blocks", "0:1", *flags]).announce_maddrs

    assert announced() == ()
    assert announced("--public-address", "203.0.113.7:40000") == ("/ip4/203.0.113.7/tcp/40000",)
    assert announced("--port", "31337", "--public-address", "box.example.org") == ("/dns4/box.example.org/tcp/31337",)
    assert announced("--public-address", "[2001:db8::7]:40000", "--announce-maddrs", "/ip4/10.0.0.7/tcp/31337") == (
        "/ip6/2001:db8::7/tcp/40000", "/ip4/10.0.0.7/tcp/31337")
    for flags, fragment in [
        (["--public-address", "203.0.113.7"], "has no port and --port is 0"),
        (["--public-address", "203.0.113.7:0"], "the port must be a number from 1 to 65535"),
        (["--public-address", "203.0.113.7:http"], "the port must be a number from 1 to 65535"),
        (["--public-address", "bad_host:5"], "is neither an IP address nor a host name"),
        (["--public-address", "300.1.2.3:5"], "is neither an IP address nor a host name"),
        (["--public-address", ":5"], "has no host"),
        (["--announce-maddrs", "not-an-address"], "--announce-maddrs: malformed multiaddr"),
        (["--announce-maddrs", "/ip4/10.0.0.7/tcp/0"], "needs a TCP port from 1 to 65535"),
        (["--announce-maddrs", PEERS[1]], "leave out the /p2p/ part"),
        (["--public-address", "203.0.113.7:5", "--relay-through", PEERS[1]], "--relay-through announces"),
    ]:
        with pytest.raises(SystemExit):
            announced(*flags)
        error = capsys.readouterr().err
        assert fragment in error and flags[0] in error, error
