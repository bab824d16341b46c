"""Anthropic's Messages API without a swarm: the request translated into chat messages and tools, the wire format,
the error envelope of every status (keys and x-api-key included), and a stream that fails midway, through the app's
test client over the tiny model run in process."""

import json

import pytest

from config import AccessSettings, GatewaySettings, ModelConfig, Settings, SwarmSettings
from gateway.anthropic import format as wire
from gateway import create_app
from gateway.anthropic.translate import chat_messages, tool_choice_of
from gateway.chat.params import ToolChoice
from gateway.engine.generation import Engine
from gateway.errors import APIError, BadRequest, NotFound, PayloadTooLarge, RateLimited, Unavailable
from gateway.chat.schemas import NamedToolChoice
from gateway.web.bodies import parse
from gateway.anthropic.schemas import AnthropicCountTokensRequest
from swarm.protocol import ServerUnavailableError
from local_remote import LocalRemote, LocalSession

TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def body(**fields):
    return parse(AnthropicCountTokensRequest, {"messages": [{"role": "user", "content": "hi"}], **fields})


def test_turns_become_chat_messages_with_tool_calls_and_tool_results_in_place():
    fields = body(system=[{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me see."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "And tomorrow?"},
                                     {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                      "content": [{"type": "text", "text": "no such day"}]}]}])
    messages = chat_messages(fields)
    assert [message.role for message in messages] == ["system", "user", "assistant", "tool", "user", "tool"]
    assert messages[0].content == "Be\nbrief."
    [call] = messages[2].tool_calls
    assert messages[2].content == "Let me see." and call.id == "toolu_1"
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert (messages[3].tool_call_id, messages[3].content) == ("toolu_1", "sunny")
    assert (messages[5].tool_call_id, messages[5].content) == ("toolu_2", "Error: no such day")


@pytest.mark.parametrize("content, field", [
    ([{"type": "tool_use", "id": "t", "name": "f", "input": {}}], "messages.0.content.0"),
    ([{"type": "text"}], "messages.0.content.0"),
    ([{"type": "image", "source": {}}], "messages.0.content.0.type"),
])
def test_misplaced_or_unserved_blocks_are_400s_that_name_them(content, field):
    with pytest.raises(BadRequest) as caught:
        chat_messages(body(messages=[{"role": "user", "content": content}]))
    assert caught.value.field == field and caught.value.message.startswith(field)


def test_tool_choices_in_openai_terms():
    assert tool_choice_of(body()) == ToolChoice("none", None, False)
    assert tool_choice_of(body(tools=[TOOL])).mode == "auto"
    any_tool = tool_choice_of(body(tools=[TOOL], tool_choice={"type": "any"}))
    assert any_tool.mode == "required" and any_tool.tools[0].function.parameters == TOOL["input_schema"] \
        and any_tool.parallel
    named = tool_choice_of(body(tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather",
                                                          "disable_parallel_tool_use": True}))
    assert named.mode == NamedToolChoice(type="function", function={"name": "get_weather"}) and not named.parallel
    assert tool_choice_of(body(tools=[TOOL], tool_choice={"type": "none"})) == ToolChoice("none", None, False)
    with pytest.raises(BadRequest, match="tool_choice"):
        tool_choice_of(body(tool_choice={"type": "any"}))
    with pytest.raises(BadRequest, match="tool_choice: auto needs tools"):  # was a 500 (found by the fuzz test)
        tool_choice_of(body(tool_choice={"type": "auto"}))


def test_stop_reasons_and_blocks():
    assert [wire.stop_reason(finish, stop) for finish, stop in [("stop", None), ("length", None), ("stop", "##"),
                                                                  ("cancelled", None)]] == \
           ["end_turn", "max_tokens", "stop_sequence", "end_turn"]
    block = wire.tool_use_block("f", '{"a": 1}')
    assert block["id"].startswith("toolu_") and block["input"] == {"a": 1}
    assert wire.block_start(1, block)["content_block"] == {**block, "input": {}}


@pytest.mark.parametrize("error, kind", [
    (BadRequest("x"), "invalid_request_error"), (NotFound("x"), "not_found_error"),
    (PayloadTooLarge("x"), "request_too_large"), (RateLimited("x", 3), "rate_limit_error"),
    (Unavailable("x"), "overloaded_error"), (APIError("x"), "api_error"),
])
def test_error_types_follow_anthropics(error, kind):
    shaped = wire.error_body(error)
    assert shaped["type"] == "error" and shaped["error"] == {"type": kind, "message": "x"}


@pytest.fixture
def keyed_client(tmp_path):
    gateway = GatewaySettings(models=(ModelConfig("m", "m"),), access=AccessSettings(api_keys=("k1",)))
    return create_app(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway)).test_client()


def test_every_refusal_takes_anthropics_envelope(keyed_client):
    """Refusals before any model is needed: no key, a wrong one, a bad body, a wrong method, an unknown path."""
    key = {"x-api-key": "k1"}
    replies = {
        401: keyed_client.post("/v1/messages", json={}, headers={"x-api-key": "wrong"}),
        400: keyed_client.post("/v1/messages", json={"messages": []}, headers=key),
        405: keyed_client.get("/v1/messages", headers=key),
        404: keyed_client.post("/v1/messages/batches", json={}, headers=key),
    }
    for status, reply in replies.items():
        assert reply.status_code == status and reply.json["type"] == "error", reply.json
        assert set(reply.json["error"]) == {"type", "message"} and reply.json["request_id"]
    assert replies[401].json["error"]["type"] == "authentication_error"
    assert replies[404].json["error"]["type"] == "not_found_error"
    assert keyed_client.post("/v1/messages", json={}).status_code == 401
    # an unknown path asked for by an anthropic client (it sends anthropic-version with every request)
    elsewhere = keyed_client.get("/v1/organizations", headers={**key, "anthropic-version": "2023-06-01"})
    assert elsewhere.status_code == 404 and elsewhere.json["error"]["type"] == "not_found_error"
    # the OpenAI API keeps its own envelope under the same /v1
    assert "code" in keyed_client.post("/v1/chat/completions", json={}, headers=key).json["error"]


class BreakingSession(LocalSession):
    """Stands in for a swarm session: the tiny model in process, until its servers go away at step `fail_at`."""

    def __init__(self, model, fail_at: int):
        super().__init__(model, max_length=64)
        self.fail_at = fail_at

    def step(self, *args, **kwargs):
        self.fail_at -= 1
        if self.fail_at == 0:
            raise ServerUnavailableError("every server of block 2 went away")
        return super().step(*args, **kwargs)


class BreakingRemote(LocalRemote):
    def session(self, max_length):
        return BreakingSession(self.model, fail_at=4)


def sse_events(text: str) -> list[tuple[str, dict]]:
    events = []
    for frame in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines() if not line.startswith(":"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_a_stream_that_fails_midway_ends_with_an_error_event(tiny_llama, tmp_path):
    gateway = GatewaySettings(models=(ModelConfig("tiny", str(tiny_llama), max_session_length=64),))
    settings = Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway)
    remote = BreakingRemote(tiny_llama)
    client = create_app(settings, Engine(settings, connect=lambda config: remote)).test_client()
    reply = client.post("/v1/messages", json={"model": "tiny", "max_tokens": 10, "temperature": 0, "stream": True,
                                              "messages": [{"role": "user", "content": "Hi"}]})
    assert reply.status_code == 200 and reply.mimetype == "text/event-stream"
    events = sse_events(reply.get_data(as_text=True))
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"] and names[-1] == "error"
    assert names.count("content_block_delta") <= 3 and "message_stop" not in names
    error = events[-1][1]
    assert error["error"]["type"] == "overloaded_error" and "failed or did not answer" in error["error"]["message"]
    assert "[DONE]" not in reply.get_data(as_text=True)
