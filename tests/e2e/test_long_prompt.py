"""A chat UI's first message with dozens of tool definitions (~6,600 prompt tokens) against a model trained for
8192 positions, with no context configured: the gateway's context is the model's own (bounded by what the
servers hold), so the prompt is served, and its greedy token equals the local model's.

The tiny model here is the suite's tiny Llama with max_position_embeddings = 8192, on one server of its own in
the tiny swarm. That the prefill of such a prompt never makes a decoding session wait more than a chunk is
tested round by round in tests/unit/test_batching.py, with a prompt of the same length."""


import openai
import pytest
import requests
from gunicorn_gateway import gateway_of_another_model
from shared_swarm import TINY_BLOCKS
from exact_match import assert_chat_reply_is_the_local_greedy_token
from tiny_model import build_tiny_model

PREFIX = "long-context"
TRAINED_FOR = 8192


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("long-llama"), "llama", TINY_BLOCKS,
                            max_position_embeddings=TRAINED_FOR)


@pytest.fixture(scope="module")
def long_gateway(tiny_swarm, long_model, tmp_path_factory):
    with gateway_of_another_model(tiny_swarm, "long", long_model, PREFIX, f"0:{TINY_BLOCKS}",
                                  tmp_path_factory.mktemp("long-gateway")) as gateway:  # no max_session_length
        yield gateway


def workspace_tools(count: int) -> list[dict]:
    """Tool definitions like those a popular chat UI sends with a first message."""
    return [{"type": "function", "function": {
        "name": f"workspace_tool_{number}",
        "description": f"Tool {number} of the workspace.",
        "parameters": {"type": "object", "required": ["arg_0"], "properties": {
            f"arg_{arg}": {"type": "string", "description": f"setting {arg} of operation {number}"}
            for arg in range(3)}}}} for number in range(count)]


def test_the_context_defaults_to_the_models_own(long_gateway):
    listed = requests.get(long_gateway.url + "/v1/models", timeout=60).json()["data"]
    # the tiny swarm's other models are listed too (from its catalogue), each with its own context
    assert {model["id"]: model["max_model_len"] for model in listed}["long"] == TRAINED_FOR


def test_a_chat_with_dozens_of_tools_is_served_and_matches_the_local_model(long_gateway, long_model):
    client = openai.OpenAI(base_url=long_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "What can you do for me?"}]
    tools = workspace_tools(22)  # ~6,550 prompt tokens with the tiny tokenizer
    reply = client.chat.completions.create(model="long", temperature=0, max_tokens=1, messages=messages, tools=tools)
    assert 6000 < reply.usage.prompt_tokens < TRAINED_FOR  # past the 2048 that every model used to get
    assert_chat_reply_is_the_local_greedy_token(reply, long_model, "long", messages, tools)
