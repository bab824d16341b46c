"""Tool calls streamed as the grammar writes them, on every API of real gunicorn in front of the tiny swarm, read by
the official clients: the call's name first, then its arguments in several fragments that add up to the same call as
the non-streamed reply's (a forced call keeps a random-weight model to a valid one; greedy, so both replies are the
same reply)."""

import json

import anthropic
import ollama
import openai
import pytest
import requests

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}}}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = {"model": "tiny", "temperature": 0}


@pytest.fixture(scope="module")
def oai(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="not-needed", max_retries=0)


def test_openai_chat_streams_tool_calls_deltas(oai):
    settings = {**GREEDY, "messages": QUESTION, "max_tokens": 80, "parallel_tool_calls": False,
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    with oai.chat.completions.stream(**settings) as stream:  # the client's own accumulation of the deltas
        events = list(stream)
        final = stream.get_final_completion()
    chunks = [event.chunk for event in events if event.type == "chunk"]
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    first, *fragments = calls
    assert first.function.name == "get_weather" and first.id.startswith("call_") and not first.function.arguments
    assert len(fragments) > 1 and all(call.function.name is None and call.index == 0 for call in fragments)
    whole = oai.chat.completions.create(**settings).choices[0]
    [call] = final.choices[0].message.tool_calls
    assert call.function.arguments == "".join(call.function.arguments for call in fragments) \
        == whole.message.tool_calls[0].function.arguments
    assert final.choices[0].finish_reason == whole.finish_reason == "tool_calls"


def test_responses_stream_function_call_arguments_deltas(oai):
    settings = {**GREEDY, "input": "Weather in Paris?", "max_output_tokens": 80, "parallel_tool_calls": False,
                "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": False}],
                "tool_choice": {"type": "function", "name": "get_weather"}}
    with oai.responses.stream(**settings) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert kinds[2] == "response.output_item.added" and events[2].item.name == "get_weather"
    assert len(deltas) > 1 and kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                                              "response.completed"]
    [call] = final.output
    whole = oai.responses.create(**settings).output[0]
    assert call.arguments == "".join(deltas) == whole.arguments and call.name == whole.name == "get_weather"


def test_anthropic_streams_input_json_deltas(gateway):
    client = anthropic.Anthropic(base_url=gateway.url, api_key="any", max_retries=0)
    settings = {"model": "tiny", "max_tokens": 80, "messages": QUESTION, "extra_body": {"temperature": 0},
                "tools": [{"name": "get_weather", "input_schema": WEATHER}],
                "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}}
    with client.messages.stream(**settings) as stream:  # the client parses the partial JSON as it comes
        events = list(stream)
        final = stream.get_final_message()
    started = [event.content_block for event in events if event.type == "content_block_start"]
    fragments = [event.partial_json for event in events if event.type == "input_json"]
    assert [(block.type, block.name, block.input) for block in started] == [("tool_use", "get_weather", {})]
    assert len([fragment for fragment in fragments if fragment]) > 1
    [call] = final.content
    whole = client.messages.create(**settings)
    assert call.input == json.loads("".join(fragments)) == whole.content[0].input
    assert final.stop_reason == whole.stop_reason == "tool_use"


def test_ollama_streams_each_call_in_one_chunk(gateway):
    """Ollama sends a call whole, in a message of its own, once it is written (the client has no tool_choice: the
    body goes as it would, and each line is read by the client's own types)."""
    body = {"model": "tiny", "messages": QUESTION, "tool_choice": "required", "options": {"temperature": 0,
                                                                                          "num_predict": 80},
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]}
    with requests.post(gateway.url + "/api/chat", json={**body, "stream": True}, stream=True) as streamed:
        lines = [ollama.ChatResponse.model_validate_json(line) for line in streamed.iter_lines() if line]
    calls = [line for line in lines if line.message.tool_calls]
    [call_line] = calls
    assert lines[-1].done and lines[-1].done_reason == "stop" and not lines[-1].message.tool_calls
    whole = ollama.ChatResponse.model_validate(requests.post(gateway.url + "/api/chat", json=body | {
        "stream": False}).json())
    assert call_line.message.tool_calls == whole.message.tool_calls
    assert whole.message.tool_calls[0].function.name == "get_weather"


# --------------------------------------------------------------------------- a call cut short, a key named twice

CUT = 34  # tokens: the forced call's head and its arguments' "{" are written, then max_tokens ends the reply
HEAD = '{ "name" :"get_weather" ,"arguments":{'  # what the grammar writes in those tokens, as the whole reply says


def cut_settings(**more) -> dict:
    return {**GREEDY, "messages": QUESTION, "max_tokens": CUT, "parallel_tool_calls": False, **more,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}


def test_openai_chat_a_call_cut_by_max_tokens_ends_with_length_streamed_or_not(oai):
    chunks = list(oai.chat.completions.create(**cut_settings(), stream=True))
    calls = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    assert calls[0].function.name == "get_weather" and "".join(call.function.arguments or "" for call in calls) == "{"
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    whole = oai.chat.completions.create(**cut_settings()).choices[0]
    assert (whole.finish_reason, whole.message.content, whole.message.tool_calls) == ("length", HEAD, None)


def test_responses_a_call_cut_by_max_output_tokens_is_an_incomplete_item_of_an_incomplete_response(oai):
    settings = {**GREEDY, "input": "Weather in Paris?", "max_output_tokens": CUT, "parallel_tool_calls": False,
                "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": False}],
                "tool_choice": {"type": "function", "name": "get_weather"}}
    with oai.responses.stream(**settings) as stream:  # its final response is only a completed one's: read the events
        events = list(stream)
    assert [event.type for event in events][-4:] == ["response.function_call_arguments.delta",
                                                    "response.function_call_arguments.done",
                                                    "response.output_item.done", "response.incomplete"]
    [call] = events[-1].response.output
    assert (call.status, call.name, call.arguments) == ("incomplete", "get_weather", "{")
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    whole = oai.responses.create(**settings)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"


def test_anthropic_a_tool_use_cut_by_max_tokens_stops_for_max_tokens(gateway):
    client = anthropic.Anthropic(base_url=gateway.url, api_key="any", max_retries=0)
    settings = {"model": "tiny", "max_tokens": CUT, "messages": QUESTION, "extra_body": {"temperature": 0},
                "tools": [{"name": "get_weather", "input_schema": WEATHER}],
                "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}}
    with client.messages.stream(**settings) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert [block.type for block in final.content] == ["tool_use"] and final.stop_reason == "max_tokens"
    whole = client.messages.create(**settings)
    assert [(block.type, block.text) for block in whole.content] == [("text", HEAD)]
    assert whole.stop_reason == "max_tokens"


def test_ollama_a_call_cut_by_num_predict_is_the_replys_text_streamed_or_not(gateway):
    """Ollama sends only whole calls: a cut one was sent neither as a call nor as text, and the streamed reply was
    empty where the whole reply's content was the call's text."""
    body = {"model": "tiny", "messages": QUESTION, "tool_choice": "required",
            "options": {"temperature": 0, "num_predict": CUT},
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]}
    with requests.post(gateway.url + "/api/chat", json={**body, "stream": True}, stream=True) as streamed:
        lines = [ollama.ChatResponse.model_validate_json(line) for line in streamed.iter_lines() if line]
    assert "".join(line.message.content for line in lines) == HEAD and not any(line.message.tool_calls
                                                                               for line in lines)
    assert lines[-1].done and lines[-1].done_reason == "length"
    whole = ollama.ChatResponse.model_validate(requests.post(gateway.url + "/api/chat", json={**body, "stream": False}
                                                             ).json())
    assert (whole.message.content, whole.message.tool_calls, whole.done_reason) == (HEAD, None, "length")


def test_arguments_that_name_a_key_twice_stream_as_written_and_parse_as_json_keeps_the_last(oai):
    """A model may write a key twice: the streamed fragments are what it wrote (valid JSON text, its last value
    wins when parsed), the whole reply's arguments are json.loads's reading; both end with "tool_calls"."""
    written = r'\{"name": "get_weather", "arguments": \{"city": "Paris", "city": "Tokyo"\}\}'
    settings = {**GREEDY, "messages": QUESTION, "max_tokens": 80, "extra_body": {"guided_regex": written},
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]}
    with oai.chat.completions.stream(**settings) as stream:
        list(stream)
        final = stream.get_final_completion().choices[0]
    whole = oai.chat.completions.create(**settings).choices[0]
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    assert final.message.tool_calls[0].function.arguments == '{"city": "Paris", "city": "Tokyo"}'
    assert json.loads(final.message.tool_calls[0].function.arguments) == {"city": "Tokyo"} \
        == json.loads(whole.message.tool_calls[0].function.arguments)
