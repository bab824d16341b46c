"""Ollama's request schemas, their conversion into the engine's terms, the wire format and NDJSON streams, as pure
functions (the API itself, through gunicorn and the official client: tests/e2e/test_ollama_api.py)."""

import json

import pytest
from flask import Flask

from config import GenerationDefaults
from gateway.ollama import format as wire
from gateway.engine.generation import TokenLogprob
from gateway.errors import BadRequest, NotFound
from gateway.web.ndjson import ndjson_stream
from gateway.ollama.routes import speaks as speaks_ollama
from gateway.ollama.translate import chat_messages, sampling_fields
from gateway.chat.params import constraint_spec, max_new_tokens, sampling_params, stop_fields
from gateway.web.bodies import parse
from gateway.ollama.schemas import OllamaChatRequest, OllamaEmbedRequest
from gateway.engine.stats import RequestStats
from tiny_model import build_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return parse(OllamaChatRequest, {"messages": MESSAGES, **fields})


def test_options_map_onto_the_sampling_params():
    fields = chat(options={"temperature": 0.5, "top_k": 7, "top_p": 0.8, "min_p": 0.1, "typical_p": 0.9,
                           "repeat_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.4, "seed": 11,
                           "mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2, "num_predict": 9,
                           "stop": ["</s>", "\n\n"], "num_ctx": 4096, "unknown": "ignored"})
    sampling = sampling_fields(fields, max_new_tokens=100)
    params = sampling_params(sampling, GenerationDefaults(), vocab_size=50)
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.typical_p) == (0.5, 7, 0.8, 0.1, 0.9)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.2, 0.3, 0.4)
    assert (params.seed, params.mirostat, params.mirostat_tau, params.mirostat_eta) == (11, 2, 3.0, 0.2)
    assert params.do_sample and max_new_tokens(sampling, 100, 500) == 9
    assert stop_fields(sampling) == (["</s>", "\n\n"], [])


def test_missing_options_take_the_models_defaults_and_temperature_zero_is_greedy():
    defaults = GenerationDefaults(temperature=0.7, top_k=40, repetition_penalty=1.1)
    params = sampling_params(sampling_fields(chat(), 100), defaults, vocab_size=50)
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.7, 40, 1.1)
    assert sampling_params(sampling_fields(chat(options={"temperature": 0}), 100), defaults, 50).greedy


@pytest.mark.parametrize("num_predict", [-1, -2, 0])
def test_num_predict_without_a_cap_leaves_the_context(num_predict):
    sampling = sampling_fields(chat(options={"num_predict": num_predict}), 100)
    assert max_new_tokens(sampling, 100, 30) == 30


def test_a_negative_seed_is_a_random_one_and_a_single_stop_is_a_list():
    sampling = sampling_fields(chat(options={"seed": -1, "stop": "END"}), 100)
    assert sampling.seed is None and stop_fields(sampling) == (["END"], [])


def test_num_predict_over_the_gateways_cap_names_the_option():
    with pytest.raises(BadRequest) as caught:
        sampling_fields(chat(options={"num_predict": 101}), 100)
    assert caught.value.field == "options.num_predict"


@pytest.mark.parametrize("fields, field", [
    ({"options": {"temperature": "0.7"}}, "options.temperature"),  # Ollama decodes into typed fields: no coercion
    ({"options": {"top_k": 4.5}}, "options.top_k"),
    ({"options": {"seed": True}}, "options.seed"),
    ({"options": {"top_p": 1.5}}, "options.top_p"),
    ({"options": {"stop": 5}}, "options.stop"),
    ({"options": "hot"}, "options"),
    ({"stream": 1}, "stream"),
    ({"format": "xml"}, "format"),
    ({"format": 3}, "format"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
])
def test_wrong_types_are_a_400_naming_the_field(fields, field):
    with pytest.raises(BadRequest) as caught:
        chat(**fields)
    assert caught.value.field == field and caught.value.message.startswith(field + ": ")


def test_format_becomes_a_response_format_read_leniently():
    assert constraint_spec(sampling_fields(chat(format="json"), 100)).kind == "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = constraint_spec(sampling_fields(chat(format=schema), 100))
    assert (spec.kind, spec.value, spec.strict) == ("json_schema", schema, False)
    assert sampling_fields(chat(format=""), 100).response_format is None


def test_messages_become_chat_messages_with_tool_calls_as_json_text():
    [user, call, answer] = chat_messages(chat(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]).messages)
    assert (user.role, user.content) == ("user", "Weather?")
    assert call.tool_calls[0].function.name == "get_weather"
    assert json.loads(call.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert (answer.role, answer.content, answer.name) == ("tool", "sunny", "get_weather")
    with pytest.raises(BadRequest) as caught:
        chat_messages(chat(messages=[{"role": "user", "content": "x", "images": ["aGk="]}]).messages)
    assert caught.value.field == "messages[0].images"


def test_embed_input_is_one_or_many_and_an_empty_string_is_none():
    assert parse(OllamaEmbedRequest, {"input": "a"}).input == ["a"]
    assert parse(OllamaEmbedRequest, {"input": ""}).input == []
    assert parse(OllamaEmbedRequest, {"input": ["a", "b"]}).input == ["a", "b"]


def test_reply_lines_and_the_last_one():
    part = wire.part("chat", "m", "He")
    assert part["message"] == {"role": "assistant", "content": "He"} and part["done"] is False
    assert part["created_at"].endswith("Z") and "response" not in part
    stats = RequestStats(prompt_tokens=5, completion_tokens=3, prefill_seconds=0.25, decode_seconds=0.5)
    last = wire.done("generate", "m", "", "length", wire.durations(stats, 0.125), context=[1, 2])
    assert last["response"] == "" and last["done"] is True and last["done_reason"] == "length"
    assert (last["prompt_eval_count"], last["eval_count"], last["context"]) == (5, 3, [1, 2])
    assert (last["prompt_eval_duration"], last["eval_duration"], last["load_duration"]) == (250_000_000, 500_000_000,
                                                                                             125_000_000)
    assert last["total_duration"] >= 0
    calls = [wire.tool_call(0, "f", '{"x": 1}')]
    whole = wire.done("chat", "m", "", "tool_calls", {}, tool_calls=calls)
    assert whole["done_reason"] == "stop" and whole["message"]["tool_calls"] == [
        {"function": {"index": 0, "name": "f", "arguments": {"x": 1}}}]
    assert wire.loaded("chat", "m", unloaded=False)["done_reason"] == "load"


def test_logprobs_shape():
    tokenizer = build_tokenizer()
    ids = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    [entry] = wire.logprobs(tokenizer, [TokenLogprob(ids[0], -0.5, ((ids[0], -0.5), (ids[-1], -1.5)))], top=2)
    assert entry["token"] == tokenizer.decode([ids[0]]) and entry["logprob"] == -0.5
    assert [top["logprob"] for top in entry["top_logprobs"]] == [-0.5, -1.5]
    assert "top_logprobs" not in wire.logprobs(tokenizer, [TokenLogprob(ids[0], -0.5)], top=0)[0]


def test_error_shape():
    assert wire.error_body(NotFound("unknown model 'x'", field="model")) == {"error": "unknown model 'x'"}


@pytest.mark.parametrize("path, ollama", [("/api/chat", True), ("/api/unknown", True), ("/api/v1/generate", False),
                                          ("/api/v2/generate", False), ("/api/oai/models", False),
                                          ("/v1/models", False), ("/health", False)])
def test_which_unrouted_paths_speak_ollama(path, ollama):
    with Flask(__name__).test_request_context(path):
        assert speaks_ollama() is ollama


def test_an_ndjson_stream_ends_with_a_clean_error_line_and_closes_its_source():
    closed = []

    def lines():
        try:
            yield {"response": "a"}
            raise RuntimeError("boom in /srv/secret.py")
        finally:
            closed.append(True)

    with Flask(__name__).test_request_context("/api/generate"):
        response = ndjson_stream(lines(), wire.error_body)
    assert response.mimetype == "application/x-ndjson"
    body = "".join(response.response)
    assert [json.loads(line) for line in body.splitlines()] == [
        {"response": "a"}, {"error": "internal error (see the gateway's log)"}]
    assert closed == [True] and "boom" not in body


def test_a_client_that_leaves_closes_the_generation():
    closed = []

    def lines():
        try:
            while True:
                yield {"response": "x"}
        finally:
            closed.append(True)

    with Flask(__name__).test_request_context("/api/generate"):
        stream = iter(ndjson_stream(lines(), wire.error_body).response)
    next(stream)
    stream.close()  # what gunicorn does when a write fails
    assert closed == [True]


def test_an_ndjson_stream_of_a_list():
    with Flask(__name__).test_request_context("/api/chat"):
        response = ndjson_stream([{"done": True}], wire.error_body)
    assert "".join(response.response) == '{"done": true}\n'
