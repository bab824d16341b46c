"""Ollama's API through real gunicorn in front of the tiny swarm, driven by the official ollama package, and checked
against the official openai package on the same gateway: both APIs translate onto the one generation loop, so the
same prompt and settings give the same greedy (or seeded) reply."""

import json
import math
from datetime import datetime

import ollama
import openai
import pytest
import requests

from shared_swarm import TINY_ADAPTERS

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
GREEDY = {"temperature": 0, "num_predict": 8}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "mood"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "mood": {"enum": ["happy", "sad"]}}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}}}}}]


@pytest.fixture(scope="module")
def client(gateway):
    return ollama.Client(host=gateway.url, timeout=120)


@pytest.fixture(scope="module")
def oai(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="not-needed", max_retries=0)


def token_ids(gateway, text: str, special: bool) -> list[int]:
    return requests.post(gateway.url + "/tokenize", json={"prompt": text, "add_special_tokens": special}).json()["tokens"]


def is_person(data) -> bool:
    return set(data) == {"name", "age", "mood"} and isinstance(data["name"], str) and len(data["name"]) <= 6 \
        and isinstance(data["age"], int) and 0 <= data["age"] <= 120 and data["mood"] in ("happy", "sad")


# ------------------------------------------------------------------------------------------ chat and generate


def test_chat_equals_the_openai_apis_greedy_reply(client, oai):
    reply = client.chat(model="tiny", messages=MESSAGES, options=GREEDY)
    expected = oai.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=8)
    assert reply.model == "tiny" and reply.message.role == "assistant"
    assert reply.message.content == expected.choices[0].message.content
    assert reply.done is True and reply.done_reason == expected.choices[0].finish_reason
    # as Ollama counts: only the prompt tokens evaluated, not those the servers held from an earlier request
    assert reply.eval_count == expected.usage.completion_tokens
    assert 1 <= reply.prompt_eval_count <= expected.usage.prompt_tokens
    assert reply.total_duration >= reply.prompt_eval_duration + reply.eval_duration
    assert reply.prompt_eval_duration > 0 and reply.eval_duration > 0 and reply.load_duration >= 0
    assert datetime.fromisoformat(reply.created_at.replace("Z", "+00:00")).tzinfo is not None


def test_chat_streams_ndjson_by_default(client, gateway):
    whole = client.chat(model="tiny", messages=MESSAGES, options=GREEDY)
    parts = list(client.chat(model="tiny", messages=MESSAGES, options=GREEDY, stream=True))
    assert len(parts) >= 3 and all(part.done is False for part in parts[:-1])
    last = parts[-1]
    assert last.done is True and last.done_reason == whole.done_reason and last.message.content == ""
    assert last.eval_count == whole.eval_count and last.total_duration > 0
    assert "".join(part.message.content for part in parts) == whole.message.content

    raw = requests.post(gateway.url + "/api/chat", json={"model": "tiny", "messages": MESSAGES, "options": GREEDY},
                        stream=True)  # no `stream` field: Ollama streams
    assert raw.headers["Content-Type"].startswith("application/x-ndjson") and raw.headers["X-Request-ID"]
    lines = [json.loads(line) for line in raw.iter_lines() if line]
    assert lines[-1]["done"] is True and "".join(line["message"]["content"] for line in lines) == whole.message.content


def test_generate_templated_equals_chat(client):
    generated = client.generate(model="tiny", system="Be brief.", prompt="Hello, world!", options=GREEDY)
    chatted = client.chat(model="tiny", messages=MESSAGES, options=GREEDY)
    assert generated.response == chatted.message.content and generated.done_reason == chatted.done_reason


def test_generate_raw_equals_the_openai_completion_and_its_context_continues(client, oai, gateway):
    prompt, options = "The quick brown", {"temperature": 0, "num_predict": 6}
    reply = client.generate(model="tiny", prompt=prompt, raw=True, options=options)
    expected = oai.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=6)
    assert reply.response == expected.choices[0].text and reply.done_reason == expected.choices[0].finish_reason
    prompt_ids = token_ids(gateway, prompt, special=True)
    generated = reply.eval_count - (reply.done_reason == "stop")  # the stop token is not part of the context
    assert reply.context[: len(prompt_ids)] == prompt_ids and len(reply.context) == len(prompt_ids) + generated

    more = client.generate(model="tiny", prompt=" fox", raw=True, context=reply.context, options=options)
    continued = reply.context + token_ids(gateway, " fox", special=False)
    assert more.response == oai.completions.create(model="tiny", prompt=continued, temperature=0,
                                                   max_tokens=6).choices[0].text


def test_seeded_sampling_and_stops_match_the_openai_api(client, oai):
    options = {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.02, "repeat_penalty": 1.1, "seed": 5,
               "presence_penalty": 0.3, "frequency_penalty": 0.2, "num_predict": 12, "stop": ["zz"],
               "num_ctx": 4096, "penalize_newline": True}  # Ollama's runtime options are ignored, as Ollama does
    reply = client.chat(model="tiny", messages=MESSAGES, options=options)
    expected = oai.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0.9, top_p=0.9, seed=5, presence_penalty=0.3,
        frequency_penalty=0.2, max_tokens=12, stop=["zz"], extra_body={"top_k": 20, "min_p": 0.02,
                                                                       "repetition_penalty": 1.1})
    assert reply.message.content == expected.choices[0].message.content
    assert client.chat(model="tiny", messages=MESSAGES, options=options).message.content == reply.message.content


def test_format_json_schema_is_enforced(client, oai):
    options = {"temperature": 0.7, "seed": 3, "num_predict": 60}
    reply = client.chat(model="tiny", messages=MESSAGES, format=PERSON, options=options)
    assert is_person(json.loads(reply.message.content))
    expected = oai.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0.7, seed=3, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": False}})
    assert reply.message.content == expected.choices[0].message.content

    streamed = list(client.generate(model="tiny", prompt="Hello, world!", format=PERSON, stream=True,
                                    options={**options, "num_predict": 200}))  # room for the blank space it may take
    assert streamed[-1].done_reason == "stop" and is_person(json.loads("".join(part.response for part in streamed)))


@pytest.mark.parametrize("seed, keys", [(1, 0), (4, 1)])  # with the tiny model: {\t  \n }, {"...": 7815.33}
def test_format_json_gives_json(client, seed, keys):
    reply = client.generate(model="tiny", prompt="A JSON object:", format="json",
                            options={"temperature": 1.0, "seed": seed, "num_predict": 120})
    assert reply.done_reason == "stop"  # the grammar ended the reply, not the token budget
    data = json.loads(reply.response)
    assert isinstance(data, dict) and len(data) == keys


def test_logprobs(client):
    reply = client.chat(model="tiny", messages=MESSAGES, options={"temperature": 0, "num_predict": 4}, logprobs=True,
                        top_logprobs=3)
    assert len(reply.logprobs) == 4
    for item in reply.logprobs:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == pytest.approx(item.logprob)


def test_an_empty_request_loads_the_model(client):
    assert client.chat(model="tiny", messages=[]).done_reason == "load"
    assert client.generate(model="tiny", prompt="").done_reason == "load"
    assert client.generate(model="tiny:latest", prompt="", keep_alive=0).done_reason == "unload"


# ------------------------------------------------------------------------------------------ tools


def test_tools_offered_the_model_chooses(client):
    reply = client.chat(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                        options={"temperature": 0, "num_predict": 12})
    assert reply.done and (reply.message.tool_calls or reply.message.content is not None)


def test_a_forced_tool_call_comes_back_as_ollamas_tool_calls(gateway):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
            "tool_choice": "required", "stream": False, "options": {"temperature": 0, "num_predict": 60}}
    reply = ollama.ChatResponse(**requests.post(gateway.url + "/api/chat", json=body).json())
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments["city"] in ("Paris", "Tokyo")
    assert reply.done_reason == "stop" and reply.message.content == ""

    lines = [json.loads(line) for line in requests.post(gateway.url + "/api/chat", json={**body, "stream": True})
             .text.splitlines()]
    assert [line["done"] for line in lines] == [False, True]
    assert lines[0]["message"]["tool_calls"] == [{"function": {"index": 0, **call.function.model_dump()}}]


def test_tool_history_is_accepted(client):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    reply = client.chat(model="tiny", messages=messages, tools=TOOLS, options={"temperature": 0, "num_predict": 3})
    assert reply.done


# ------------------------------------------------------------------------------------------ embeddings and models


def test_embed_is_normalized_and_the_older_route_is_not(client, oai):
    reply = client.embed(model="tiny", input=["hello", "goodbye world"])
    first, second = reply.embeddings
    assert len(first) == len(second) == 64 and first != second and reply.prompt_eval_count > 0
    assert math.fsum(value * value for value in first) == pytest.approx(1.0)
    unnormalized = oai.embeddings.create(model="tiny", input="hello").data[0].embedding
    norm = math.sqrt(math.fsum(value * value for value in unnormalized))
    assert first == pytest.approx([value / norm for value in unnormalized], abs=1e-6)
    assert client.embeddings(model="tiny", prompt="hello").embedding == pytest.approx(unnormalized)
    cut = client.embed(model="tiny", input="hello", dimensions=8).embeddings[0]
    assert len(cut) == 8 and math.fsum(value * value for value in cut) == pytest.approx(1.0)
    assert client.embed(model="tiny", input="").embeddings == []


def test_list_show_ps_and_version(client, gateway):
    models = client.list().models  # the adapters, then the embedding models (tests/e2e/test_embedding_models.py)
    assert [model.model for model in models][:3] == ["tiny", *(f"tiny:{name}" for name in TINY_ADAPTERS)]
    listed = models[0]
    assert listed.model == "tiny" and listed.details.family == "llama" and len(listed.digest) == 64
    shown = client.show("tiny")
    assert shown.details.family == "llama" and shown.modelinfo["llama.context_length"] == 1024
    assert shown.modelinfo["llama.block_count"] == 4 and "completion" in shown.capabilities
    assert "tools" in shown.capabilities and "im_start" in shown.template
    assert [model.model for model in client.ps().models] == ["tiny"]
    assert requests.get(gateway.url + "/api/version").json()["version"].count(".") == 2


def test_ollama_requests_are_counted_under_their_own_label(client, gateway):
    client.list()
    metrics = requests.get(gateway.url + "/metrics").text
    assert 'gateway_requests_total{api="ollama",status="200"}' in metrics


# ------------------------------------------------------------------------------------------ errors

GOOD = {"model": "tiny", "messages": MESSAGES, "stream": False}


@pytest.mark.parametrize("path, body, status, named", [
    ("/api/chat", {**GOOD, "model": "nope"}, 404, "'nope'"),
    ("/api/chat", {**GOOD, "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ("/api/chat", {**GOOD, "options": {"top_p": 5}}, 400, "options.top_p"),
    ("/api/chat", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("/api/chat", {**GOOD, "format": "xml"}, 400, "format"),
    ("/api/chat", {**GOOD, "format": {"type": "nonsense"}}, 400, "format"),
    ("/api/chat", {**GOOD, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/api/chat", {**GOOD, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400, "images"),
    ("/api/chat", {**GOOD, "think": True}, 400, "think"),
    ("/api/chat", {**GOOD, "tool_choice": "required"}, 400, "tool_choice"),
    ("/api/chat", {**GOOD, "messages": [{"role": "user", "content": "word " * 1000}]}, 400, "messages"),
    ("/api/generate", {"prompt": "x", "options": {"num_predict": 10**6}}, 400, "options.num_predict"),
    ("/api/generate", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/api/generate", {"prompt": "x", "template": "{{ .Prompt }}"}, 400, "template"),
    ("/api/generate", {"prompt": "x", "context": [-1]}, 400, "context"),
    ("/api/embed", {"input": 3}, 400, "input"),
    ("/api/embed", {"input": "x", "dimensions": 10**6}, 400, "dimensions"),
    ("/api/show", {"model": "nope"}, 404, "'nope'"),
    ("/api/pull", {"model": "tiny"}, 404, "not found"),
    ("/api/chat", "not json", 400, "JSON"),
    ("/api/chat", ["a list"], 400, "object"),
])
def test_bad_requests_get_ollamas_error_shape(gateway, path, body, status, named):
    sent = {"data": body} if isinstance(body, str) else {"json": body}
    reply = requests.post(gateway.url + path, **sent)
    assert reply.status_code == status and list(reply.json()) == ["error"], reply.text
    assert named in reply.json()["error"] and "Traceback" not in reply.text


def test_the_client_raises_ollamas_response_errors(client, gateway):
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="nope", messages=MESSAGES)
    assert caught.value.status_code == 404 and "nope" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        list(client.generate(model="tiny", prompt="x", options={"top_k": "many"}, stream=True))
    assert caught.value.status_code == 400 and "options.top_k" in caught.value.error
    wrong_method = requests.get(gateway.url + "/api/chat")
    assert wrong_method.status_code == 405 and list(wrong_method.json()) == ["error"]


def test_keys_guard_every_route_but_version(strict_gateway):
    url = strict_gateway.url
    assert requests.get(url + "/api/version").status_code == 200
    refused = requests.get(url + "/api/tags")
    assert refused.status_code == 401 and list(refused.json()) == ["error"] and "API key" in refused.json()["error"]
    keyed = ollama.Client(host=url, headers={"Authorization": "Bearer key-ollama"})
    assert [model.model for model in keyed.list().models][0] == "tiny"
    with pytest.raises(ollama.ResponseError) as caught:
        keyed.generate(model="tiny", prompt="x" * 9000)  # over MAX_BODY_BYTES
    assert caught.value.status_code == 413
