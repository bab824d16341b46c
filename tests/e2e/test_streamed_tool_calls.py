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
