"""LoRA adapters through the shared gateway: "model:adapter" names a model through an adapter its servers announce,
on every API (the official openai and ollama clients here); replies equal transformers + peft; /v1/models and
Ollama's /api/tags list each adapter with its base model; an adapter no server announces is a 404 naming `model`."""

import ollama
import openai
import pytest
import requests
import torch
import transformers

from shared_swarm import TINY_ADAPTERS

MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="not-needed", max_retries=0)


@pytest.fixture(scope="module")
def local(tiny_llama, tiny_peft_model):
    return tiny_peft_model, transformers.AutoTokenizer.from_pretrained(tiny_llama)


def local_reply(local, adapter: str) -> str:
    """The local greedy chat reply through `adapter`, up to the end-of-sequence token."""
    model, tokenizer = local
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    model.set_adapter(adapter)
    with torch.no_grad():
        output = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    new = output[0, len(ids):].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id)]
    return tokenizer.decode(new)


@pytest.mark.parametrize("adapter", TINY_ADAPTERS)
def test_openai_chat_through_an_adapter_equals_local_peft(client, local, adapter):
    reply = client.chat.completions.create(model=f"tiny:{adapter}", messages=MESSAGES, temperature=0,
                                           max_tokens=NEW_TOKENS)
    assert reply.model == f"tiny:{adapter}"
    assert reply.choices[0].message.content == local_reply(local, adapter)


def test_the_adapters_change_the_reply(client, local):
    replies = {model: client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                                     max_tokens=NEW_TOKENS).choices[0].message.content
               for model in ("tiny", *(f"tiny:{adapter}" for adapter in TINY_ADAPTERS))}
    assert len(set(replies.values())) == 3, replies


def test_ollama_chat_names_the_adapter_as_a_tag(gateway, local):
    adapter = TINY_ADAPTERS[1]
    reply = ollama.Client(host=gateway.url, timeout=120).chat(
        model=f"tiny:{adapter}", messages=MESSAGES, options={"temperature": 0, "num_predict": NEW_TOKENS})
    assert reply.message.content == local_reply(local, adapter)


def test_models_list_each_adapter_with_its_base(client, gateway):
    listed = {model.id: model for model in client.models.list().data}
    for adapter in TINY_ADAPTERS:
        assert listed[f"tiny:{adapter}"].model_extra["parent"] == "tiny"
    assert "parent" not in listed["tiny"].model_extra
    tags = {entry["name"]: entry for entry in requests.get(gateway.url + "/api/tags", timeout=30).json()["models"]}
    assert tags[f"tiny:{TINY_ADAPTERS[0]}"]["details"]["parent_model"] == "tiny"


def test_an_adapter_no_server_announces_is_a_404_naming_model(client):
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="tiny:no-such-adapter", messages=MESSAGES, max_tokens=2)
    error = refused.value.body
    assert "no-such-adapter" in error["message"] and error.get("param") == "model"
    assert TINY_ADAPTERS[0] in error["message"]  # it names the adapters there are
