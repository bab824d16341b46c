"""The OpenAI-compatible API through real gunicorn in front of the tiny swarm, driven by the official client."""

import base64
import json
import math
import struct
import time

import openai
import pytest
import requests
import torch
import transformers

from shared_swarm import TINY_ADAPTERS

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="not-needed", max_retries=0)


@pytest.fixture(scope="module")
def local(tiny_llama):
    return (transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval(),
            transformers.AutoTokenizer.from_pretrained(tiny_llama))


def local_greedy(local, ids, count):
    model, tokenizer = local
    with torch.no_grad():
        output = model.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False)
    new = [token for token in output[0, len(ids):].tolist() if token != tokenizer.eos_token_id]
    return tokenizer.decode(new), len(new)


def chat_prompt_ids(local):
    tokenizer = local[1]
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def test_chat_completion_equals_local_greedy(client, local):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=8)
    ids = chat_prompt_ids(local)
    text, count = local_greedy(local, ids, 8)
    assert reply.object == "chat.completion" and reply.model == "tiny"
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == ("length" if count == 8 else "stop")  # local_greedy drops the eos
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), count)
    assert reply.usage.total_tokens == len(ids) + count
    # the prompt tokens computed: those the servers held from an earlier test's request took no time
    check_timing(reply.usage.model_extra, len(ids) - reply.usage.prompt_tokens_details.cached_tokens, count)


def check_timing(timing: dict, prompt_tokens: int, completion_tokens: int) -> None:
    """mistral.rs's usage extras: each rate is its tokens over its time (the first token is the prefill's)."""
    def rate_times_time(rate: str, seconds: str, tokens: int):
        # both values are rounded to 3 decimals: allow exactly that much error in their product
        assert timing[rate] * timing[seconds] == pytest.approx(tokens, abs=timing[rate] * 6e-4 + timing[seconds] * 6e-4)

    assert timing["total_prompt_time_sec"] > 0 and timing["total_completion_time_sec"] > 0
    assert timing["total_time_sec"] >= timing["total_prompt_time_sec"] + timing["total_completion_time_sec"] - 0.002
    rate_times_time("avg_prompt_tok_per_sec", "total_prompt_time_sec", prompt_tokens)
    rate_times_time("avg_compl_tok_per_sec", "total_completion_time_sec", completion_tokens - 1)
    rate_times_time("avg_tok_per_sec", "total_time_sec", prompt_tokens + completion_tokens)


def test_chat_stream_chunks(client):
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=8)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=8,
                                                 stream=True))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(chunk.usage is None for chunk in chunks)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text == full.choices[0].message.content and len(chunks) >= 4


def test_include_usage_adds_a_last_chunk(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=5,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_n_and_seed(client):
    ask = lambda seed: client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, n=2,
                                                      max_tokens=12, seed=seed)
    first, again, other = ask(7), ask(7), ask(8)
    texts = lambda reply: [choice.message.content for choice in reply.choices]
    assert [choice.index for choice in first.choices] == [0, 1]
    assert texts(first) == texts(again)
    assert texts(first)[0] != texts(first)[1] and texts(first) != texts(other)
    assert first.usage.completion_tokens == 24


def test_logprobs_with_top_logprobs(client):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=5,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        values = [top.logprob for top in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token


def test_completions_with_echo_and_logprobs(client, local):
    prompt = "The quick brown"
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    choice = reply.choices[0]
    assert reply.object == "text_completion" and choice.text.startswith(prompt)
    prompt_ids = local[1](prompt)["input_ids"]
    generated, _ = local_greedy(local, prompt_ids, 4)
    assert choice.text == prompt + generated
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + 4 == len(logprobs.token_logprobs) == len(logprobs.text_offset)
    assert logprobs.token_logprobs[0] is None and all(value <= 0 for value in logprobs.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])  # a dict: equal texts merge
    assert "".join(logprobs.tokens) == choice.text


def test_completions_stream_and_prompt_lists(client, local):
    prompts = ["Hello", "World"]
    chunks = list(client.completions.create(model="tiny", prompt=prompts, max_tokens=3, temperature=0, stream=True))
    assert {chunk.choices[0].index for chunk in chunks} == {0, 1}
    assert sum(1 for chunk in chunks if chunk.choices[0].finish_reason) == 2
    for index, prompt in enumerate(prompts):
        text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices[0].index == index)
        assert text == local_greedy(local, local[1](prompt)["input_ids"], 3)[0]


def test_json_schema_output_validates(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "mood"],
              "properties": {"name": {"type": "string", "maxLength": 6},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120},
                             "mood": {"enum": ["happy", "sad"]}}}
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60, temperature=0.7, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    data = json.loads(reply.choices[0].message.content)
    assert set(data) == {"name", "age", "mood"} and isinstance(data["age"], int) and 0 <= data["age"] <= 120
    assert isinstance(data["name"], str) and len(data["name"]) <= 6 and data["mood"] in ("happy", "sad")


@pytest.mark.parametrize("seed, keys", [(1, 0), (3, 0), (9, 1)])  # with the tiny model: {}, {\n\t\r}, {"...": ...}
def test_json_object_output_parses(client, seed, keys):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, temperature=1.0,
                                           seed=seed, response_format={"type": "json_object"}, stop=None)
    assert reply.choices[0].finish_reason == "stop"  # the grammar ended the reply, not the token budget
    data = json.loads(reply.choices[0].message.content)
    assert isinstance(data, dict) and len(data) == keys


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Tokyo"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def test_forced_tool_call_parses(client):
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Tokyo")


def test_required_tool_call_streams_as_tool_calls(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, temperature=0, stream=True))
    calls = [call for chunk in chunks if chunk.choices and chunk.choices[0].delta.tool_calls
             for call in chunk.choices[0].delta.tool_calls]
    assert calls and calls[0].index == 0 and calls[0].function.name in ("get_weather", "get_time")
    json.loads("".join(call.function.arguments for call in calls))  # streamed as written: name first, then fragments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_history_is_accepted(client):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_history_reaches_the_model_as_json(client, local):
    """A template that knows no tool_calls sees the assistant's earlier call as the JSON it was asked to write."""
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                 "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    rendered = [messages[0], {"role": "assistant", "content": json.dumps(call)},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tokenizer = local[1]
    prompt = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == local_greedy(local, ids, 6)[0]


def local_hidden_states(local, text: str) -> tuple:
    """transformers' hidden_states of the text: [0] the embeddings, [i] after block i, [-1] after the final norm."""
    model, tokenizer = local
    with torch.no_grad():
        return model.model(torch.tensor([tokenizer(text)["input_ids"]]), output_hidden_states=True).hidden_states


def test_embeddings_are_mean_pooled_hidden_states(client, local):
    texts = ["hello", "goodbye world"]
    reply = client.embeddings.create(model="tiny", input=texts)
    assert [item.index for item in reply.data] == [0, 1]
    for text, item in zip(texts, reply.data):  # the last block's output after the final norm, not normalized
        expected = local_hidden_states(local, text)[-1][0].mean(dim=0)
        torch.testing.assert_close(torch.tensor(item.embedding), expected, atol=1e-4, rtol=1e-4)
    assert reply.usage.prompt_tokens == sum(len(local[1](text)["input_ids"]) for text in texts)
    hidden = local_hidden_states(local, "goodbye world")
    for layer in (0, 1, 2, 4):  # Ai00's layer: transformers' hidden_states[layer]; 0 is the token embeddings
        early = client.embeddings.create(model="tiny", input="goodbye world", extra_body={"layer": layer})
        torch.testing.assert_close(torch.tensor(early.data[0].embedding), hidden[layer][0].mean(dim=0),
                                   atol=1e-4, rtol=1e-4)
    encoded = client.embeddings.create(model="tiny", input="hello", encoding_format="base64").data[0].embedding
    decoded = struct.unpack("<64f", base64.b64decode(encoded))
    assert decoded == pytest.approx(reply.data[0].embedding, abs=1e-6)


def test_models_list(client):
    # the model, the LoRA adapters its servers announce (tests/e2e/test_adapters_api.py), then the shared gateway's
    # embedding models (tests/e2e/test_embedding_models.py)
    assert [model.id for model in client.models.list().data][:3] == ["tiny", *(f"tiny:{name}" for name in TINY_ADAPTERS)]


def test_ai00_routes_and_extras(gateway, local):
    for prefix in ("/api/oai", "/api/oai/v1"):
        reply = requests.post(gateway.url + prefix + "/chat/completions",
                              json={"messages": MESSAGES, "max_tokens": 2, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["object"] == "chat.completion"
        assert reply.json()["choices"][0]["message"]["content"] == local_greedy(local, chat_prompt_ids(local), 2)[0]
        assert requests.get(gateway.url + prefix + "/models").json()["data"][0]["id"] == "tiny"

    tokens = requests.post(gateway.url + "/tokenize", json={"prompt": "Hello, world!"}).json()
    assert tokens["tokens"] == local[1]("Hello, world!")["input_ids"] and tokens["count"] == len(tokens["tokens"])
    text = requests.post(gateway.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "Hello, world!"
    stats = requests.get(gateway.url + "/stats").json()
    assert stats["decode_tokens_per_s"] > 0 and stats["prefill_tokens_per_s"] > 0  # the replies above decoded
    assert requests.get(gateway.url + "/verbose_stats").json()["requests"] >= 2


def local_perplexity(local, context: str, choice: str) -> float:
    """exp of the mean negative log-likelihood of the choice's tokens after the context's."""
    model, tokenizer = local
    context_ids, choice_ids = tokenizer(context)["input_ids"], tokenizer(choice, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([context_ids + choice_ids])).logits[0], dim=-1)
    scored = [float(logprobs[len(context_ids) + index - 1, token]) for index, token in enumerate(choice_ids)]
    return math.exp(-sum(scored) / len(scored))


def test_chooses_ranks_by_the_local_models_perplexity(gateway, local):
    choices = [" zzz", " world", " fox", "!", " quick brown"]
    data = requests.post(gateway.url + "/api/oai/chooses", json={"input": "Hello,", "choices": choices}).json()["data"]
    expected = sorted((local_perplexity(local, "Hello,", choice), index) for index, choice in enumerate(choices))
    assert [item["index"] for item in data] == [index for _, index in expected]
    assert [item["rank"] for item in data] == list(range(len(choices)))
    assert [item["choice"] for item in data] == [choices[index] for _, index in expected]
    assert [item["perplexity"] for item in data] == pytest.approx([value for value, _ in expected], rel=1e-4)
    assert [index for _, index in expected] != list(range(len(choices)))  # the route did reorder them


SAMPLER_FIELDS = ("top_k", "min_p", "typical_p", "repetition_penalty", "penalty_decay", "mirostat", "mirostat_tau",
                  "mirostat_eta")  # the ones the openai client does not know: sent in extra_body


def sampled(client, count=12, **fields) -> str:
    extra = {name: fields.pop(name) for name in SAMPLER_FIELDS if name in fields}
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=count, extra_body=extra,
                                           **fields)
    return reply.choices[0].message.content


def local_sample(local, params, count=12) -> str:
    """The reply the gateway's sampler draws from the local model's logits: the same generator, seeded alike."""
    from gateway.engine.sampler import Sampler

    model, tokenizer = local
    ids = chat_prompt_ids(local)
    sampler, new = Sampler(params, model.config.vocab_size, context=ids), []
    with torch.no_grad():
        for _ in range(count):
            token = sampler(model(torch.tensor([ids + new])).logits[0, -1])
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
    return tokenizer.decode(new)


@pytest.mark.parametrize("fields", [{"temperature": 0, "seed": 3}, {"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}],
                         ids=["temperature-0", "top_k-1", "min_p-1", "top_p-tiny"])
def test_samplers_that_keep_one_token_are_greedy(client, local, fields):
    greedy = local_greedy(local, chat_prompt_ids(local), 12)[0]
    assert sampled(client, **{"temperature": 1.0, "seed": 3, **fields}) == greedy
    assert sampled(client, temperature=1.0, seed=3) != greedy  # so that the equality above means something


def test_a_seed_reproduces_a_sample_and_filters_that_are_off_change_nothing(client, local):
    from gateway.engine.sampling import SamplingParams

    first = sampled(client, temperature=1.0, seed=3)
    assert first == local_sample(local, SamplingParams(do_sample=True, seed=3))
    assert sampled(client, temperature=1.0, seed=3) == first
    assert sampled(client, temperature=1.0, seed=4) != first
    assert sampled(client, temperature=1.0, seed=3, top_p=1.0, top_k=0, min_p=0.0, typical_p=1.0) == first


def test_every_sampler_field_takes_effect(client, local):
    from gateway.engine.sampling import SamplingParams

    fields = {"temperature": 0.8, "top_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": 0.5,
              "top_k": 20, "min_p": 0.05, "typical_p": 0.9, "repetition_penalty": 1.1, "penalty_decay": 0.99}
    reply = sampled(client, seed=5, logit_bias={"5": 10}, stop=["zzz", "qq"], **fields)
    expected = local_sample(local, SamplingParams(do_sample=True, seed=5, logit_bias={5: 10}, **fields))
    assert reply == expected and "zzz" not in expected and "qq" not in expected
    assert reply != sampled(client, seed=5, temperature=0.8)


@pytest.mark.parametrize("fields", [{"mirostat": 2, "mirostat_tau": 2.0, "mirostat_eta": 0.2},
                                    {"mirostat": 1, "mirostat_tau": 3.0, "mirostat_eta": 0.1}], ids=["v2", "v1"])
def test_mirostat_samples_as_defined_and_reproducibly(client, local, fields):
    from gateway.engine.sampling import SamplingParams

    reply = sampled(client, count=16, temperature=1.0, seed=1, **fields)
    assert reply == local_sample(local, SamplingParams(do_sample=True, seed=1, **fields), 16)
    assert sampled(client, count=16, temperature=1.0, seed=1, **fields) == reply
    assert sampled(client, count=16, temperature=1.0, seed=2, **fields) != reply
    assert reply != sampled(client, count=16, temperature=1.0, seed=1)  # not plain sampling
    assert reply != local_greedy(local, chat_prompt_ids(local), 16)[0]


def test_ai00_sampler_override_is_mirostat_v2(gateway, local):
    from gateway.engine.sampling import SamplingParams

    body = {"messages": MESSAGES, "max_tokens": 16, "temperature": 1.0, "seed": 1,
            "sampler_override": {"type": "Mirostat", "tau": 2.0, "rate": 0.2}}
    reply = requests.post(gateway.url + "/api/oai/chat/completions", json=body)
    expected = local_sample(local, SamplingParams(do_sample=True, seed=1, mirostat=2, mirostat_tau=2.0,
                                                  mirostat_eta=0.2), 16)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == expected


def test_logit_bias_forces_a_token(client, gateway):
    forced = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0,
                                            logit_bias={"65": 100})
    assert forced.choices[0].logprobs is None
    tokenizer_piece = requests.post(gateway.url + "/detokenize", json={"tokens": [65, 65, 65]}).json()["prompt"]
    assert forced.choices[0].message.content == tokenizer_piece


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": MESSAGES, "temperature": -1}, "temperature"),
        ({"messages": MESSAGES, "n": 0}, "n"),
        ({"messages": MESSAGES, "max_tokens": 10**9}, "max_tokens"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": MESSAGES, "logit_bias": {"999999": 1}}, "logit_bias"),
        ({"messages": MESSAGES, "response_format": {"type": "json_schema",
                                                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format"),
        ({"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "word " * 1000}]}, "messages"),
    ],
)
def test_bad_requests_raise_bad_request(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", **kwargs)
    error = caught.value.body
    assert error["type"] == "invalid_request_error" and param in (error["param"] or "") + error["message"]
    assert "Traceback" not in json.dumps(error)


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert caught.value.body["code"] == "model_not_found"


def test_not_json_is_400_not_422(gateway):
    reply = requests.post(gateway.url + "/v1/chat/completions", data="nope", headers={"Content-Type": "text/plain"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


def test_client_disconnect_stops_generation_and_closes_the_session(gateway):
    with requests.post(gateway.url + "/v1/completions", stream=True,
                       json={"prompt": "Go", "max_tokens": 200, "stream": True, "temperature": 0}) as reply:
        lines = reply.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and requests.get(gateway.url + "/health").json()["open_sessions"]:
        time.sleep(0.2)
    assert requests.get(gateway.url + "/health").json()["open_sessions"] == 0


def test_openapi_and_docs(gateway):
    document = requests.get(gateway.url + "/openapi.json").json()
    assert "/v1/chat/completions" in document["paths"] and "ChatCompletionRequest" in document["components"]["schemas"]
    page = requests.get(gateway.url + "/docs")
    assert page.status_code == 200 and "/docs/assets/swagger-ui-bundle.js" in page.text and "http" not in page.text.split("<body>")[1].replace("/openapi.json", "")
    assert requests.get(gateway.url + "/docs/assets/swagger-ui-bundle.js").status_code == 200


def test_more_inputs_than_openais_2048_are_refused_before_any_runs(gateway):
    """Each input is a forward through the swarm: past OpenAI's cap (MAX_INPUTS_PER_REQUEST) none runs."""
    reply = requests.post(gateway.url + "/v1/embeddings", json={"input": ["a"] * 2049}, timeout=30)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "input"
    assert "at most 2048 inputs in one request, got 2049" in error["message"]
