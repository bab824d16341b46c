"""Anthropic's Messages API through real gunicorn in front of the tiny swarm, driven by the official anthropic client;
its greedy replies checked against the OpenAI API's for the same conversation, through the official openai client."""

import json

import anthropic
import jsonschema_rs  # schemathesis's JSON Schema validator
import openai
import pytest
import requests
import transformers

from shared_gateways import STRICT_LIMITS

SYSTEM = "Be brief."
MESSAGES = [{"role": "user", "content": "Hello, world!"}]
OPENAI_MESSAGES = [{"role": "system", "content": SYSTEM}, *MESSAGES]
WEATHER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city"],
                  "properties": {"city": {"enum": ["Paris", "Tokyo"]}}}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_SCHEMA},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}  # OpenAI's finish_reason -> Anthropic's stop_reason
# the anthropic client (2.x) no longer names the sampling fields that the API still takes: they go as extra_body
SAMPLING = ("temperature", "top_p", "top_k")


@pytest.fixture(scope="module")
def client(gateway):
    return anthropic.Anthropic(base_url=gateway.url, api_key="any", max_retries=0)


@pytest.fixture(scope="module")
def openai_client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="any", max_retries=0)


def settings_of(**kwargs) -> dict:
    """The client's arguments for a greedy reply (unless told otherwise), sampling fields in extra_body."""
    settings = {"model": "tiny", "system": SYSTEM, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, **kwargs}
    sampling = {name: settings.pop(name) for name in SAMPLING if name in settings}
    return {**settings, "extra_body": sampling}


def prompt_of(usage) -> int:
    """The whole prompt's tokens: Anthropic's input_tokens leave out those read from the cache (a warm conversation
    of an earlier test: gateway/engine/warm.py)."""
    if isinstance(usage, dict):
        return usage["input_tokens"] + usage["cache_read_input_tokens"]
    return usage.input_tokens + usage.cache_read_input_tokens


def ask(client, **kwargs):
    return client.messages.create(**settings_of(**kwargs))


def text_of(message) -> str:
    [block] = message.content
    assert block.type == "text"
    return block.text


def test_greedy_message_equals_the_openai_chat_reply(client, openai_client):
    message = ask(client)
    reply = openai_client.chat.completions.create(model="tiny", messages=OPENAI_MESSAGES, max_tokens=12, temperature=0)
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert message.id.startswith("msg_")
    assert text_of(message) == reply.choices[0].message.content and text_of(message)
    assert message.stop_reason == STOP_REASONS[reply.choices[0].finish_reason] and message.stop_sequence is None
    assert (prompt_of(message.usage), message.usage.output_tokens) == \
           (reply.usage.prompt_tokens, reply.usage.completion_tokens)
    # the same system prompt as text blocks, the same user turn as a text block, top_k and top_p that keep the best
    blocks = ask(client, system=[{"type": "text", "text": SYSTEM}], top_k=5, top_p=0.9, metadata={"user_id": "u1"},
                 messages=[{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}])
    assert text_of(blocks) == text_of(message)


def test_max_tokens_ends_the_reply(client):
    message = ask(client, max_tokens=3)
    if message.stop_reason == "max_tokens":  # else the model ended its turn first
        assert message.usage.output_tokens == 3
    else:
        assert message.stop_reason == "end_turn" and message.usage.output_tokens < 3


def raw_events(gateway, **body) -> list[tuple[str, dict]]:
    """The SSE frames as sent (the client hides the pings): (event name, data) each."""
    body = {"model": "tiny", "system": SYSTEM, "messages": MESSAGES, "temperature": 0, "stream": True, **body}
    reply = requests.post(gateway.url + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert reply.status_code == 200 and reply.headers["Content-Type"].startswith("text/event-stream")
    events = []
    for frame in reply.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines() if not line.startswith(":"))
        events.append((lines["event"], json.loads(lines["data"])))
    assert all(name == data["type"] for name, data in events)
    return events


def test_stream_events_come_in_anthropics_order(client, gateway):
    message = ask(client)
    events = raw_events(gateway, max_tokens=12)
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"] and deltas >= 2
    start, last = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and prompt_of(start["usage"]) == prompt_of(message.usage)
    assert "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta") == text_of(message)
    assert last["delta"] == {"stop_reason": message.stop_reason, "stop_sequence": None}
    assert last["usage"]["output_tokens"] == message.usage.output_tokens


def test_the_clients_stream_helpers_rebuild_the_same_message(client):
    message = ask(client)
    settings = settings_of()
    with client.messages.stream(**settings) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == text_of(final) == text_of(message)
    assert (final.stop_reason, final.usage.output_tokens) == (message.stop_reason, message.usage.output_tokens)
    events = list(client.messages.create(stream=True, **settings))
    assert [event.type for event in events[:2]] == ["message_start", "content_block_start"]
    assert [event.type for event in events[-3:]] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences(client, gateway):
    full = text_of(ask(client, max_tokens=20))
    stop = full[4:7]
    message = ask(client, max_tokens=20, stop_sequences=["never-said", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert text_of(message) == full[: full.index(stop)]
    last = raw_events(gateway, max_tokens=20, stop_sequences=[stop])[-2][1]
    assert last["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_forced_tool_call_gives_a_tool_use_block_that_validates(client):
    message = ask(client, max_tokens=60, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert message.stop_reason == "tool_use"
    [call] = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema_rs.validate(WEATHER_SCHEMA, call.input)


def test_any_tool_streams_as_input_json_deltas(client, gateway):
    body = {"max_tokens": 60, "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [{"role": "user", "content": "Weather?"}]}
    with client.messages.stream(**settings_of(**body)) as stream:
        final = stream.get_final_message()
    [call] = final.content
    assert final.stop_reason == "tool_use" and call.type == "tool_use" and call.name in ("get_weather", "get_time")
    events = raw_events(gateway, **body)
    start = next(data for name, data in events if name == "content_block_start")["content_block"]
    partial = "".join(data["delta"]["partial_json"] for name, data in events if name == "content_block_delta")
    assert start["type"] == "tool_use" and start["input"] == {} and json.loads(partial) == call.input


def tool_conversation(result_blocks):
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": result_blocks}]


def test_tool_results_render_as_openai_tool_messages(client, openai_client):
    """The same conversation through both APIs: the same prompt (token count) and the same greedy reply."""
    messages = tool_conversation([{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 24 C"}])
    message = ask(client, tools=TOOLS, messages=messages)
    openai_tools = [{"type": "function", "function": {"name": tool["name"], "description": tool.get("description"),
                                                      "parameters": tool["input_schema"]}} for tool in TOOLS]
    reply = openai_client.chat.completions.create(
        model="tiny", max_tokens=12, temperature=0, tools=openai_tools, messages=[
            {"role": "system", "content": SYSTEM}, messages[0],
            {"role": "assistant", "content": None, "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 24 C"}])
    assert prompt_of(message.usage) == reply.usage.prompt_tokens
    if reply.choices[0].message.tool_calls:
        assert message.stop_reason == "tool_use"
    else:
        assert text_of(message) == reply.choices[0].message.content


def test_count_tokens_is_the_messages_input(client):
    for kwargs in ({}, {"tools": TOOLS}, {"messages": tool_conversation(
            [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "rain"}]}])}):
        settings = {"model": "tiny", "system": SYSTEM, "messages": MESSAGES, **kwargs}
        counted = client.messages.count_tokens(**settings)
        assert counted.input_tokens == prompt_of(client.messages.create(max_tokens=1, **settings).usage) > 0


def test_a_prefilled_reply_goes_on_from_the_assistants_text(client, openai_client, tiny_llama):
    messages = [*MESSAGES, {"role": "assistant", "content": "Well,"}]
    message = ask(client, messages=messages, max_tokens=8)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, *messages], tokenize=False,
                                           continue_final_message=True)
    assert prompt.endswith("Well,")
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    reply = openai_client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert prompt_of(message.usage) == len(ids) and text_of(message) == reply.choices[0].text


@pytest.mark.parametrize("kwargs, message_part", [
    ({"temperature": 1.5}, "temperature"),
    ({"max_tokens": 5000}, "max_tokens"),  # the client refuses unstreamed requests for many more itself
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "messages.0.content.0.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_mood"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "word " * 1000}]}, "messages"),
])
def test_bad_requests_are_anthropic_400s(client, kwargs, message_part):
    with pytest.raises(anthropic.BadRequestError) as caught:
        ask(client, **kwargs)
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert message_part in body["error"]["message"] and "Traceback" not in json.dumps(body)


def test_unknown_model_and_path_are_not_found(client, gateway):
    with pytest.raises(anthropic.NotFoundError) as caught:
        ask(client, model="claude-9")
    assert caught.value.body["error"]["type"] == "not_found_error" and "tiny" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.list()
    missing = requests.post(gateway.url + "/v1/messages", json={"model": "tiny", "messages": MESSAGES})
    assert missing.status_code == 400 and missing.json()["error"]["message"] == "max_tokens: Field required"


def test_requests_are_counted_in_metrics(client, gateway):
    ask(client, max_tokens=1)
    metrics = requests.get(gateway.url + "/metrics").text
    assert 'gateway_requests_total{api="anthropic",status="200"}' in metrics


def test_keys_come_as_x_api_key_and_limits_apply(strict_gateway):
    def keyed(key):
        return anthropic.Anthropic(base_url=strict_gateway.url, api_key=key, max_retries=0)

    with pytest.raises(anthropic.AuthenticationError) as caught:
        keyed("wrong").messages.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert caught.value.body["error"]["type"] == "authentication_error"
    allowed = keyed("key-anthropic")
    assert allowed.messages.create(model="tiny", messages=MESSAGES, max_tokens=2).usage.output_tokens <= 2
    with pytest.raises(anthropic.BadRequestError, match="MAX_NEW_TOKENS"):
        allowed.messages.create(model="tiny", messages=MESSAGES, max_tokens=STRICT_LIMITS["MAX_NEW_TOKENS"] + 1)
    too_large = [{"role": "user", "content": "x" * STRICT_LIMITS["MAX_BODY_BYTES"]}]
    with pytest.raises(anthropic.APIStatusError) as caught:
        allowed.messages.create(model="tiny", messages=too_large, max_tokens=2)
    assert caught.value.status_code == 413 and caught.value.body["error"]["type"] == "request_too_large"
