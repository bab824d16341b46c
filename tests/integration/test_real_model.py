"""The real default model, SmolLM2-135M-Instruct, through a two-server swarm (blocks 0:15 and 15:30)."""

import pytest
import torch
import transformers

from conftest import run_tool

pytestmark = pytest.mark.real_model

PROMPT = "Write a short story about a robot who learns to paint."


def test_converted_model_is_the_expected_llama(real_model):
    config = transformers.AutoConfig.from_pretrained(real_model)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert transformers.AutoTokenizer.from_pretrained(real_model).chat_template


def test_a_span_loads_only_its_blocks(real_model):
    from swarm.server.span import load_span

    span = load_span(real_model, 0, 15)
    held = {name.split(".")[2] for name in span.loaded_names}
    assert held == {str(index) for index in range(15)}
    assert all(name.startswith("model.layers.") for name in span.loaded_names)
    parameters = sum(parameter.numel() for parameter in span.parameters())
    per_block = sum(parameter.numel() for parameter in span.layers[0].parameters())
    assert parameters == 15 * per_block  # no embeddings, no LM head, no other block


def test_servers_hold_only_their_blocks(real_swarm, real_model, settings):
    from swarm.client import SwarmClient

    client = SwarmClient(real_swarm.initial_peers)
    try:
        servers = sorted(client.servers("SmolLM2-135M-Instruct", 30), key=lambda server: server.info.start)
        assert [(server.info.start, server.info.end) for server in servers] == [(0, 15), (15, 30)]
        for server in servers:
            info = client.server_info(server.peer_id)
            blocks = {int(name.split(".")[2]) for name in info["loaded_names"]}
            assert blocks == set(range(info["start"], info["end"]))
    finally:
        client.shutdown()


def test_generate_prints_what_transformers_prints(real_swarm, real_model):
    result = run_tool("-m", "swarm.client.generate", "--initial-peers", *real_swarm.initial_peers,
                      "--model", "SmolLM2-135M-Instruct", "--prompt", PROMPT, "--chat", "--max-new-tokens", "128",
                      timeout=300)
    assert result.returncode == 0, result.stderr

    tokenizer = transformers.AutoTokenizer.from_pretrained(real_model)
    model = transformers.AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=128, do_sample=False)
    expected = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert len(expected) > 200  # a long answer, so that the comparison means something
    assert result.stdout == expected + "\n"
