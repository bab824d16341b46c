"""Tool calls streamed on every API as they are written (each dialect's formatter of chat/reply.py's call events):
the call's name first, then its arguments in several fragments that add up to the non-streamed call's, the text
before it told as text; read by hand here, by the official clients in tests/e2e/test_streamed_tool_calls.py."""

import json
import re
from types import SimpleNamespace

from gateway.anthropic.format import MessageReply
from gateway.chat.reasoning import NO_THINKING
from gateway.chat.schemas import Tool
from gateway.engine.generation import Delta
from gateway.engine.stats import RequestStats
from gateway.ollama.format import OllamaReply
from gateway.openai import format as openai_wire
from gateway.openai.responses import format as responses_wire
from gateway.openai.responses.routes import ResponseRun
from gateway.openai.responses.schemas import ResponseCreateRequest

TOOLS = [Tool.model_validate({"type": "function", "function": {"name": name}}) for name in ("get_weather", "get_time")]
WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
WEATHER_ARGUMENTS = json.dumps({"city": "Paris", "days": 3})


class ToolPlan:
    """Stands in for chat.plan.Plan: one reply with tools offered, a token a delta; `given`: how many deltas it has
    given so far."""

    thinking, n, cached_tokens, prompt_ids, tools = NO_THINKING, 1, 0, [1, 2, 3], TOOLS
    model = SimpleNamespace(name="tiny", tokenizer=None)

    def __init__(self, text: str):
        tokens = re.findall(r'\w+|\W', text)
        self.deltas = [Delta(token, 1, "stop" if last else None) for last, token in
                       zip([False] * (len(tokens) - 1) + [True], tokens)]
        self.given = 0

    def run(self, cancelled, stats):
        for delta in self.deltas:
            self.given += 1
            yield 0, delta


def openai_chunks(text: str) -> list[dict]:
    return list(openai_wire.ChatCompletionReplies(ToolPlan(text), None, False, RequestStats()).chunks(lambda: False))


def openai_whole(text: str) -> dict:
    return openai_wire.ChatCompletionReplies(ToolPlan(text), None, False, RequestStats()).completion()["choices"][0]


def test_openai_chunks_name_the_call_first_then_stream_its_arguments_as_the_completion_has_them():
    chunks = openai_chunks(WEATHER_CALL)
    calls = [call for chunk in chunks for call in chunk["choices"][0]["delta"].get("tool_calls", [])]
    first, *fragments = calls
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""} and len(fragments) > 1
    assert all(call == {"index": 0, "function": {"arguments": call["function"]["arguments"]}} for call in fragments)
    whole = openai_whole(WEATHER_CALL)
    [call] = whole["message"]["tool_calls"]
    assert "".join(call["function"]["arguments"] for call in calls) == call["function"]["arguments"]
    assert whole["message"]["content"] is None
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"] == "tool_calls"


def test_openai_text_before_a_tagged_call_is_content_streamed_before_the_call():
    reply = "Sure.\n<tool_call>" + WEATHER_CALL
    deltas = [chunk["choices"][0]["delta"] for chunk in openai_chunks(reply)]
    first_call = next(number for number, delta in enumerate(deltas) if "tool_calls" in delta)
    content = [delta["content"] for delta in deltas[1:first_call]]
    assert len(content) > 1 and "".join(content) == "Sure.\n"
    whole = openai_whole(reply)
    assert whole["message"]["content"] == "Sure.\n" and whole["message"]["tool_calls"][0]["function"]["arguments"] \
        == WEATHER_ARGUMENTS


def test_anthropic_streams_a_tool_use_block_as_input_json_deltas():
    events = list(MessageReply(ToolPlan(WEATHER_CALL), None).events(lambda: False))
    blocks = [event for event in events if event["type"].startswith("content_block")]
    start, *deltas, stop = blocks
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["name"] == "get_weather"
    assert start["content_block"]["input"] == {} and start["content_block"]["id"].startswith("toolu_")
    assert len(deltas) > 1 and {delta["delta"]["type"] for delta in deltas} == {"input_json_delta"}
    assert stop == {"type": "content_block_stop", "index": 0}
    [whole] = MessageReply(ToolPlan(WEATHER_CALL), None).message()["content"]
    assert json.loads("".join(delta["delta"]["partial_json"] for delta in deltas)) == whole["input"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_anthropic_text_before_a_call_is_a_text_block_then_the_tool_use_block():
    reply = "Sure.<tool_call>" + WEATHER_CALL
    events = list(MessageReply(ToolPlan(reply), None).events(lambda: False))
    starts = [(event["index"], event["content_block"]["type"]) for event in events
              if event["type"] == "content_block_start"]
    assert starts == [(0, "text"), (1, "tool_use")]
    text, call = MessageReply(ToolPlan(reply), None).message()["content"]
    assert text == {"type": "text", "text": "Sure."} and call["input"] == {"city": "Paris", "days": 3}


def responses_events(text: str) -> tuple[list[dict], ResponseRun]:
    request = ResponseCreateRequest.model_validate({"model": "tiny", "input": "Weather?"})
    run = ResponseRun(responses_wire.response_object("resp_1", "tiny", request), ToolPlan(text), None)
    return list(run.events(lambda: False)), run


def test_responses_stream_a_function_call_item_as_argument_deltas():
    events, run = responses_events(WEATHER_CALL)
    kinds = [event["type"] for event in events[2:]]
    arguments = [event["delta"] for event in events if event["type"] == "response.function_call_arguments.delta"]
    assert kinds == ["response.output_item.added", *["response.function_call_arguments.delta"] * len(arguments),
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[2]["item"]["name"] == "get_weather" and events[2]["item"]["arguments"] == ""
    assert events[2]["item"]["status"] == "in_progress"
    assert len(arguments) > 1 and "".join(arguments) == WEATHER_ARGUMENTS
    [call] = events[-1]["response"]["output"]
    assert call["arguments"] == WEATHER_ARGUMENTS and call["status"] == "completed"
    assert run.conversation[-1]["tool_calls"][0]["id"] == call["call_id"]


def test_responses_text_before_a_call_is_a_message_item_closed_before_the_call_item():
    events, run = responses_events("Sure.<tool_call>" + WEATHER_CALL)
    kinds = [(event["type"], event.get("output_index")) for event in events[2:]]
    assert kinds[:9] == [("response.output_item.added", 0), ("response.content_part.added", 0),
                         ("response.output_text.delta", 0), ("response.output_text.delta", 0),
                         ("response.output_text.done", 0), ("response.content_part.done", 0),
                         ("response.output_item.done", 0), ("response.output_item.added", 1),
                         ("response.function_call_arguments.delta", 1)]
    message, call = events[-1]["response"]["output"]
    assert message["content"][0]["text"] == "Sure." and call["arguments"] == WEATHER_ARGUMENTS
    assert run.conversation[-1]["content"] == "Sure."


def test_ollama_sends_each_call_whole_in_a_line_of_its_own_as_soon_as_it_is_written():
    reply = "[" + WEATHER_CALL + ', {"name": "get_time", "arguments": {}}]'
    plan = ToolPlan(reply)
    lines = OllamaReply("chat", plan, RequestStats(), 0.0).lines()
    first = next(lines)
    assert first["message"]["tool_calls"] == [
        {"function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]
    assert plan.given < len(plan.deltas) - 10  # sent before the second call was written
    second, last = list(lines)
    whole = OllamaReply("chat", ToolPlan(reply), RequestStats(), 0.0).whole()
    assert first["message"]["tool_calls"] + second["message"]["tool_calls"] == whole["message"]["tool_calls"]
    assert last["done"] and last["done_reason"] == "stop"


def test_ollama_streams_the_text_before_a_call_as_content():
    lines = list(OllamaReply("chat", ToolPlan("Sure.<tool_call>" + WEATHER_CALL), RequestStats(), 0.0).lines())
    assert [line["message"]["content"] for line in lines[:2]] == ["Sure", "."]
    assert lines[2]["message"]["tool_calls"][0]["function"]["name"] == "get_weather" and lines[3]["done"]
