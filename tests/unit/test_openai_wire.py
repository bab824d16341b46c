"""OpenAI's wire format and parameter conversion, as pure functions."""

import json

import pytest
from flask import Flask

from config import GenerationDefaults
from gateway.openai import format as wire
from gateway.engine.generation import TokenLogprob
from gateway.errors import BadRequest, NotFound, TooManySessions
from gateway.chat.params import ai00_sampler, max_new_tokens, sampling_params, stop_fields
from gateway.openai.schemas import ChatCompletionRequest
from gateway.chat.schemas import SamplerOverride
from gateway.web.bodies import parse
from gateway.web.sse import event_stream
from tiny_model import build_tokenizer

TOKENIZER = build_tokenizer()


def request(**fields):
    return parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **fields})


def test_chat_logprobs_shape():
    ids = TOKENIZER("Hello", add_special_tokens=False)["input_ids"]
    items = [TokenLogprob(ids[0], -0.5, ((ids[0], -0.5), (ids[-1], -1.5)))]
    shaped = wire.chat_logprobs(TOKENIZER, items)
    [entry] = shaped["content"]
    assert entry["token"] == TOKENIZER.decode([ids[0]]) and entry["logprob"] == -0.5
    assert entry["bytes"] == list(entry["token"].encode()) and [top["logprob"] for top in entry["top_logprobs"]] == [-0.5, -1.5]


def test_completion_logprobs_shape_with_an_echoed_first_token():
    ids = TOKENIZER("Hello world", add_special_tokens=False)["input_ids"]
    items = [None] + [TokenLogprob(token, -1.0, ((token, -1.0),)) for token in ids[1:]]
    shaped = wire.completion_logprobs(TOKENIZER, items, ids)
    assert "".join(shaped["tokens"]) == "Hello world"
    assert shaped["token_logprobs"][0] is None and shaped["top_logprobs"][0] is None
    assert shaped["text_offset"][0] == 0 and shaped["text_offset"][1] == len(shaped["tokens"][0])


def test_chunks_and_usage():
    chunk = wire.chat_chunk("id", "m", 1, {"content": "x"}, finish_reason="cancelled", with_usage_field=True)
    assert chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None
    assert chunk["choices"] == [{"index": 1, "delta": {"content": "x"}, "logprobs": None, "finish_reason": "stop"}]
    usage = wire.usage_chunk("id", "m", "chat.completion.chunk", wire.usage(3, 4, cached_tokens=2))
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                                         "prompt_tokens_details": {"cached_tokens": 2}}
    choice = wire.chat_choice(0, None, "tool_calls", tool_calls=[wire.tool_call("f", "{}")])
    assert choice["message"]["content"] is None and choice["message"]["tool_calls"][0]["function"]["name"] == "f"


def test_error_envelope():
    body = wire.error_body(NotFound("unknown model 'x'", field="model"))
    assert body == {"error": {"message": "unknown model 'x'", "type": "invalid_request_error", "param": "model",
                              "code": "model_not_found"}}
    assert wire.error_body(TooManySessions("busy"))["error"]["type"] == "rate_limit_error"


def test_sampling_params_follow_openai_defaults():
    params = sampling_params(request(), GenerationDefaults(), 100)
    assert params.do_sample and params.temperature == 1.0
    greedy = sampling_params(request(temperature=0, top_k=-1, logit_bias={"7": 5}), GenerationDefaults(), 100)
    assert not greedy.do_sample and greedy.top_k == 0 and greedy.logit_bias == ((7, 5.0),)
    with pytest.raises(BadRequest, match="logit_bias"):
        sampling_params(request(logit_bias={"100": 1}), GenerationDefaults(), 100)
    with pytest.raises(BadRequest, match="logit_bias"):
        sampling_params(request(bias={"3": 101}), GenerationDefaults(), 100)


def test_ai00_sampler_override():
    assert ai00_sampler(SamplerOverride(type="Mirostat", tau=3.0, rate=0.2)) == {
        "mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2}
    nucleus = ai00_sampler(SamplerOverride(type="Nucleus", temperature=0.5, penalty=100))
    assert nucleus["temperature"] == 0.5 and nucleus["penalty_decay"] == pytest.approx(0.5 ** 0.01)
    assert ai00_sampler(SamplerOverride(type="Typical", tau=0.8))["typical_p"] == 0.8


def test_token_budget_and_stops():
    assert max_new_tokens(request(max_tokens=5, max_completion_tokens=7), 100, 50) == 7
    assert max_new_tokens(request(), 100, 50) == 50
    with pytest.raises(BadRequest, match="max_tokens: at most 100"):
        max_new_tokens(request(max_tokens=101), 100, 50)
    assert stop_fields(request(stop="x")) == (["x"], [])
    assert stop_fields(request(stop=["a", 7], stop_token_ids=[9])) == (["a"], [7, 9])


def stream_body(events, keepalive=10.0):
    app = Flask(__name__)
    with app.test_request_context():
        response = event_stream(events, wire.error_body, keepalive=keepalive)
    return "".join(response.response)


def test_sse_events_then_done():
    body = stream_body(lambda cancelled: iter([{"a": 1}, {"b": 2}]))
    assert body == 'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'


def test_sse_error_is_a_last_event():
    def events(cancelled):
        yield {"a": 1}
        raise BadRequest("bad thing", field="x")

    frames = stream_body(events).split("\n\n")
    assert json.loads(frames[1].removeprefix("data: "))["error"]["message"] == "bad thing"
    assert frames[2] == "data: [DONE]" and "Traceback" not in "".join(frames)


def test_sse_keepalive_comments_fill_silences():
    import time

    def slow(cancelled):
        time.sleep(0.35)
        yield {"late": True}

    body = stream_body(slow, keepalive=0.1)
    assert body.count(": keep-alive\n\n") >= 2 and body.endswith('data: {"late": true}\n\ndata: [DONE]\n\n')
