"""OpenAI's Responses API through real gunicorn in front of the tiny swarm, driven by the official client's
`client.responses`: every reply is checked against what the chat completions API says for the same conversation."""

import json
import time

import jsonschema_rs  # schemathesis's JSON Schema validator
import openai
import pytest
import requests

INSTRUCTIONS, QUESTION = "Be brief.", "Hello, world!"
MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"enum": ["Paris", "Tokyo"]}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="not-needed", max_retries=0)


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kwargs)


def test_greedy_reply_equals_chat_completions(client):
    response = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=QUESTION, temperature=0,
                                       max_output_tokens=8)
    reply = chat(client, MESSAGES, max_tokens=8)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == "tiny"
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert response.output_text == reply.choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (reply.usage.prompt_tokens,
                                                                           reply.usage.completion_tokens)
    if reply.choices[0].finish_reason == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None
    assert response.instructions == INSTRUCTIONS and response.max_output_tokens == 8 and response.store


def test_input_items_equal_the_same_chat(client):
    items = [{"role": "developer", "content": INSTRUCTIONS},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    response = client.responses.create(model="tiny", input=items, temperature=0, max_output_tokens=6)
    assert response.output_text == chat(client, MESSAGES, max_tokens=6).choices[0].message.content


def test_stream_events_in_order_and_the_same_text(client):
    whole = client.responses.create(model="tiny", input=QUESTION, temperature=0, max_output_tokens=12)
    events = list(client.responses.create(model="tiny", input=QUESTION, temperature=0, max_output_tokens=12,
                                          stream=True))
    types = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-1] == {"completed": "response.completed", "incomplete": "response.incomplete"}[whole.status]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text == events[-1].response.output_text
    assert events[0].response.status == "in_progress" and events[-1].response.status == whole.status
    item_ids = {event.item_id for event in events if hasattr(event, "item_id")}
    assert item_ids == {events[2].item.id} == {events[-1].response.output[0].id}


def test_the_sdk_stream_helper_accumulates_the_same_reply(client):
    # a reply that completes (the helper wants response.completed): JSON that is one of two strings
    answer = {"format": {"type": "json_schema", "name": "answer", "schema": {"enum": ["yes", "no"]}}}
    whole = client.responses.create(model="tiny", input=QUESTION, temperature=0, text=answer)
    with client.responses.stream(model="tiny", input=QUESTION, temperature=0, text=answer) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text and final.output_text in ('"yes"', '"no"')
    assert final.status == whole.status == "completed"


def test_sse_frames_are_named_by_their_type_with_no_done_marker(gateway):
    with requests.post(gateway.url + "/api/oai/v1/responses", stream=True,
                       json={"input": QUESTION, "max_output_tokens": 3, "stream": True}) as reply:
        assert reply.status_code == 200 and reply.headers["Content-Type"].startswith("text/event-stream")
        frames = [frame for frame in reply.text.split("\n\n") if frame.strip()]
    for frame in frames:
        name, data = frame.split("\n")
        assert name.startswith("event: ") and json.loads(data.removeprefix("data: "))["type"] == name[7:]
    assert "[DONE]" not in reply.text


def test_retrieve_and_delete(client):
    created = client.responses.create(model="tiny", input=QUESTION, temperature=0, max_output_tokens=4)
    fetched = client.responses.retrieve(created.id)
    assert (fetched.id, fetched.status, fetched.output_text) == (created.id, created.status, created.output_text)
    client.responses.delete(created.id)
    for gone in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(openai.NotFoundError) as caught:
            gone(created.id)
        assert caught.value.body["param"] == "response_id"
    unstored = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_follow_up_sees_the_earlier_turn(client):
    first = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=QUESTION, temperature=0,
                                    max_output_tokens=6)
    second = client.responses.create(model="tiny", input="And then?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=6)
    # the instructions are not carried on (as OpenAI has it); the earlier question and reply are
    transcript = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": "And then?"}]
    reply = chat(client, transcript, max_tokens=6)
    assert second.previous_response_id == first.id
    assert second.output_text == reply.choices[0].message.content
    assert second.usage.input_tokens == reply.usage.prompt_tokens
    alone = client.responses.create(model="tiny", input="And then?", temperature=0, max_output_tokens=6)
    assert alone.usage.input_tokens < second.usage.input_tokens
    third = client.responses.create(model="tiny", input="More.", previous_response_id=second.id, temperature=0,
                                    max_output_tokens=6)
    longer = transcript + [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "More."}]
    assert third.output_text == chat(client, longer, max_tokens=6).choices[0].message.content


def test_function_call_output_item_validates_against_the_tool(client):
    response = client.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, temperature=0,
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       parallel_tool_calls=False, max_output_tokens=60)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and response.status == "completed"
    jsonschema_rs.validate(WEATHER, json.loads(call.arguments))
    # the call's result as the next input: the model sees the call and its output, as chat's tool messages
    follow = client.responses.create(model="tiny", previous_response_id=response.id, temperature=0,
                                     max_output_tokens=5, input=[{"type": "function_call_output",
                                                                  "call_id": call.call_id, "output": "sunny"}])
    transcript = [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    assert follow.output_text == chat(client, transcript, max_tokens=5).choices[0].message.content


def test_required_function_call_streams_its_arguments(client):
    events = list(client.responses.create(model="tiny", input="Weather?", tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_output_tokens=60, stream=True))
    types = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(deltas), "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    added, *_, done, item_done, completed = events[2:]
    assert added.item.type == "function_call" and added.item.arguments == "" and added.item.status == "in_progress"
    assert "".join(deltas) == done.arguments == item_done.item.arguments == completed.response.output[0].arguments
    assert done.name in ("get_weather", "get_time") and isinstance(json.loads(done.arguments), dict)


def test_json_schema_text_format(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "mood"],
              "properties": {"name": {"type": "string", "maxLength": 6},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120},
                             "mood": {"enum": ["happy", "sad"]}}}
    response = client.responses.create(
        model="tiny", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=60, temperature=0.7,
        extra_body={"seed": 3}, text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}})
    jsonschema_rs.validate(schema, json.loads(response.output_text))
    assert response.text.format.type == "json_schema" and response.status == "completed"
    same = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60, temperature=0.7, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    assert response.output_text == same.choices[0].message.content  # the same sampling, seeded alike


def test_background_response_is_polled_and_cancelled(client):
    response = client.responses.create(model="tiny", input="Go", background=True, temperature=0,
                                       max_output_tokens=200)
    assert response.status == "in_progress" and response.background and response.output == []
    cancelled = client.responses.cancel(response.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 200
    assert client.responses.retrieve(response.id).status == "cancelled"
    assert client.responses.cancel(response.id).status == "cancelled"  # again: the same answer

    finished = client.responses.create(model="tiny", input="Go", background=True, max_output_tokens=3)
    deadline = time.monotonic() + 30
    while finished.status == "in_progress" and time.monotonic() < deadline:
        time.sleep(0.1)
        finished = client.responses.retrieve(finished.id)
    assert finished.status in ("completed", "incomplete") and finished.usage.output_tokens <= 3
    with pytest.raises(openai.BadRequestError):  # nothing left to cancel
        client.responses.cancel(finished.id)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"input": ""}, "input"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input.0.arguments"),
        ({"input": "x", "temperature": -1}, "temperature"),
        ({"input": "x", "max_output_tokens": 10**9}, "max_output_tokens"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
         "text.format"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": "word " * 1000}, "input"),
        ({"input": "x", "background": True, "store": False}, "background"),
    ],
)
def test_bad_requests_get_openai_errors(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", **kwargs)
    error = caught.value.body
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param)
    assert "Traceback" not in json.dumps(error)


def test_unknown_previous_response_and_model_are_not_found(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    assert caught.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="gpt-9", input="x")
    assert caught.value.body["code"] == "model_not_found"


def test_prefixes_metrics_and_the_openapi_document(gateway):
    def counted() -> float:
        lines = requests.get(gateway.url + "/metrics").text.splitlines()
        return sum(float(line.split()[-1]) for line in lines
                   if line.startswith('gateway_requests_total{api="openai",status="404"}'))

    before = counted()
    for prefix in ("/v1", "/api/oai", "/api/oai/v1"):
        reply = requests.get(gateway.url + prefix + "/responses/resp_unknown")
        assert reply.status_code == 404 and reply.json()["error"]["type"] == "invalid_request_error"
    assert counted() == before + 3
    not_json = requests.post(gateway.url + "/v1/responses", data="nope", headers={"Content-Type": "text/plain"})
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"
    paths = requests.get(gateway.url + "/openapi.json").json()["paths"]
    assert set(paths["/v1/responses/{response_id}"]) == {"get", "delete"} and "post" in paths["/v1/responses"]
    assert paths["/v1/responses/{response_id}/cancel"]["post"]["parameters"][0]["name"] == "response_id"
