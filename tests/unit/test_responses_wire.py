"""The Responses API without a swarm: its translation into a chat request, its run over scripted deltas (events in
order, statuses, errors), its wire format, and the store's limits."""

import json

import pytest

from gateway.chat.reasoning import NO_THINKING, Thinking
from gateway.openai.responses import format as wire
from gateway.engine.generation import Delta
from gateway.errors import BadRequest, LengthExceeded, NotFound, Unavailable
from gateway.openai.responses.routes import ResponseRun
from gateway.openai.responses.translate import chat_request, in_responses_terms, input_messages
from gateway.openai.responses.store import ResponseStore, StoredResponse
from gateway.openai.schemas import ChatCompletionRequest
from gateway.web.bodies import parse
from gateway.openai.responses.schemas import ResponseCreateRequest

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


def request(**fields) -> ResponseCreateRequest:
    return parse(ResponseCreateRequest, {"input": "Hi", **fields})


# ------------------------------------------------------------------------------------------ into chat's terms


def test_input_items_become_chat_messages():
    items = request(input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                          {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
    ]).input
    messages = input_messages(items)
    assert messages[:2] == [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "a\nb"}]
    assert messages[2]["role"] == "assistant" and [call["id"] for call in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3:] == [{"role": "tool", "tool_call_id": "c1", "content": "one"},
                            {"role": "tool", "tool_call_id": "c2", "content": "two"},
                            {"role": "assistant", "content": "done"}]
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]


def test_the_chat_request_has_instructions_then_history_then_input():
    history = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "reply"}]
    fields = request(instructions="Be brief.", temperature=0.5, top_p=0.9, max_output_tokens=7, seed=3, top_k=5,
                     tools=[{"type": "function", "name": "w", "parameters": WEATHER}],
                     tool_choice={"type": "function", "name": "w"}, parallel_tool_calls=False)
    chat, added = chat_request(fields, history)
    assert isinstance(chat, ChatCompletionRequest) and added == [{"role": "user", "content": "Hi"}]
    assert [(message.role, message.content) for message in chat.messages] == [
        ("system", "Be brief."), ("user", "before"), ("assistant", "reply"), ("user", "Hi")]
    assert (chat.temperature, chat.top_p, chat.max_completion_tokens, chat.seed, chat.top_k) == (0.5, 0.9, 7, 3, 5)
    assert chat.tools[0].function.name == "w" and chat.tools[0].function.parameters == WEATHER
    assert chat.tool_choice.function == {"name": "w"} and chat.parallel_tool_calls is False


def test_text_format_becomes_response_format():
    schema_format = {"type": "json_schema", "name": "p", "schema": WEATHER, "strict": True}
    chat, _ = chat_request(request(text={"format": schema_format}), [])
    assert chat.response_format.json_schema.schema_ == WEATHER and chat.response_format.json_schema.strict
    assert chat_request(request(text={"format": {"type": "json_object"}}), [])[0].response_format.type == "json_object"
    assert chat_request(request(text={"format": {"type": "text"}}), [])[0].response_format is None
    with pytest.raises(BadRequest) as caught:
        chat_request(request(text={"format": {"type": "json_schema", "name": "p"}}), [])
    assert caught.value.field == "text.format.schema"


def test_bad_function_call_arguments_are_named():
    with pytest.raises(BadRequest) as caught:
        input_messages(request(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "1"}]).input)
    assert caught.value.field == "input.0.arguments"


@pytest.mark.parametrize("error, field, message", [
    (LengthExceeded("... reduce the length of the messages.", field="messages"), "input", "the input."),
    (BadRequest("max_completion_tokens: at most 4", field="max_completion_tokens"), "max_output_tokens",
     "max_output_tokens: at most 4"),
    (BadRequest("response_format: invalid", field="response_format"), "text.format", "text.format: invalid"),
    (BadRequest("tools: bad", field="tools"), "tools", "tools: bad"),
])
def test_errors_name_this_apis_fields(error, field, message):
    with pytest.raises(type(error)) as caught, in_responses_terms():
        raise error
    assert caught.value.field == field and caught.value.message.endswith(message)


# ------------------------------------------------------------------------------------------ a run


class ScriptedPlan:
    """Stands in for chat.plan.Plan: the deltas of one reply to a 5-token prompt, then perhaps an error."""

    def __init__(self, deltas, tools=None, error=None, thinking=NO_THINKING):
        self.deltas, self.tools, self.error, self.thinking = deltas, tools, error, thinking
        self.prompt_ids, self.n, self.cached_tokens = [0] * 5, 1, 0

    def run(self, cancelled, stats):
        for delta in self.deltas:
            if cancelled():
                yield 0, Delta("", 0, "cancelled")
                return
            yield 0, delta
        if self.error is not None:
            raise self.error


def run_of(deltas, tools=None, error=None, thinking=NO_THINKING, **fields) -> ResponseRun:
    body = wire.response_object("resp_1", "tiny", request(**fields))
    return ResponseRun(body, ScriptedPlan(deltas, tools, error, thinking), None)


def test_a_text_reply_streams_its_events_in_order():
    run = run_of([Delta("Hel", 1), Delta("lo", 1), Delta("", 1, "stop")])
    events = list(run.events(lambda: False))
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert [event["type"] for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["input_tokens"] == 5 and final["usage"]["output_tokens"] == 3
    assert run.conversation[-1] == {"role": "assistant", "content": "Hello"}


def test_a_thinking_reply_is_a_reasoning_item_then_the_message():
    deltas = [Delta("<think>\nthe user", 2), Delta(" greets\n</think>\n\nHel", 3), Delta("lo", 1, "stop")]
    run = run_of(deltas, thinking=Thinking(split=True, opened=False), reasoning={"effort": "high"})
    events = list(run.events(lambda: False))
    assert [(event["type"], event.get("output_index")) for event in events][2:] == [
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0), ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1), ("response.output_text.delta", 1),
        ("response.output_text.delta", 1), ("response.output_text.done", 1), ("response.content_part.done", 1),
        ("response.output_item.done", 1), ("response.completed", None)]
    final = events[-1]["response"]
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text",
                                                                         "text": "the user greets"}]
    assert message["content"][0]["text"] == "Hello" and final["reasoning"]["effort"] == "high"
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 5
    assert run.conversation[-1] == {"role": "assistant", "content": "Hello"}  # earlier reasoning is left out


def test_a_reasoning_effort_of_none_turns_thinking_off_and_reasoning_items_are_left_out():
    chat, messages = chat_request(request(input=[{"type": "reasoning", "id": "rs_1", "summary": []},
                                                 {"role": "user", "content": "Hi"}], reasoning={"effort": "none"}), [])
    assert chat.reasoning_effort == "none" and messages == [{"role": "user", "content": "Hi"}]


def test_a_reply_cut_short_is_incomplete():
    final = run_of([Delta("a", 1), Delta("b", 1, "length")]).complete()
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"


def test_a_tool_call_reply_is_a_function_call_item():
    tools = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "w", "parameters": WEATHER}}]}).tools
    call = json.dumps({"name": "w", "arguments": {"city": "Paris"}})
    run = run_of([Delta(call[:5], 1), Delta(call[5:], 1, "stop")], tools=tools)
    events = list(run.events(lambda: False))
    assert [event["type"] for event in events][2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    [item] = events[-1]["response"]["output"]
    assert item["type"] == "function_call" and item["name"] == "w"
    assert json.loads(item["arguments"]) == {"city": "Paris"}
    assert run.conversation[-1]["tool_calls"][0]["id"] == item["call_id"]


def test_a_cancel_stops_the_reply():
    run = run_of([Delta("a", 1)] * 5)
    run.cancel.set()
    final = run.complete()
    assert final["status"] == "cancelled" and final["output"][0]["content"][0]["text"] == ""


def test_an_error_midway_is_a_failed_response_not_a_traceback():
    run = run_of([Delta("a", 1)], error=Unavailable("the swarm is gone"))
    events = list(run.events(lambda: False))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "the swarm is gone"}
    with pytest.raises(Unavailable):  # a request that waits for the whole reply gets the error itself
        run_of([], error=Unavailable("gone")).complete()


def test_the_stored_record_follows_the_run():
    store = ResponseStore(4, 60.0)
    run = run_of([Delta("ok", 1, "stop")])
    record = StoredResponse("resp_1", "ip:1", run.body)
    run.keep_in(store, record, [{"role": "user", "content": "Hi"}])
    assert store.get("resp_1", "ip:2").body["status"] == "in_progress" and not record.finished.is_set()
    run.complete()
    assert record.finished.is_set() and record.body["status"] == "completed"
    assert record.conversation == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "ok"}]


# ------------------------------------------------------------------------------------------ the store


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stored(store: ResponseStore, response_id: str, owner: str = "ip:1", finished: bool = True) -> StoredResponse:
    record = StoredResponse(response_id, owner, {"id": response_id})
    store.add(record)
    if finished:
        store.finish(record)
    return record


def test_the_store_forgets_the_least_recently_used_over_its_cap():
    store = ResponseStore(2, 60.0, clock=Clock())
    stored(store, "a"), stored(store, "b")
    store.get("a", "ip:1")  # "b" is now the least recently used
    stored(store, "c")
    assert len(store) == 2 and store.get("a", "ip:1") and store.get("c", "ip:1")
    with pytest.raises(NotFound):
        store.get("b", "ip:1")


def test_idle_records_expire_but_not_while_generating():
    clock = Clock()
    store = ResponseStore(10, 5.0, clock=clock)
    stored(store, "done"), stored(store, "running", finished=False)
    clock.now = 4.0
    store.get("done", "ip:1")  # reading it keeps it
    clock.now = 8.5  # 4.5 s since it was read
    assert store.get("done", "ip:1")
    clock.now = 20.0
    with pytest.raises(NotFound):
        store.get("done", "ip:1")
    assert store.get("running", "ip:1").id == "running"


def test_with_keys_only_the_creator_sees_it_and_delete_cancels():
    store = ResponseStore(10, 60.0)
    record = stored(store, "r", owner="key:alice", finished=False)
    with pytest.raises(NotFound):
        store.get("r", "key:mallory")
    assert store.get("r", "key:alice") is record
    assert store.remove("r", "key:alice") is record and record.cancel.is_set()
    with pytest.raises(NotFound):
        store.remove("r", "key:alice")


def test_failure_codes():
    assert wire.failure(BadRequest("x"))["code"] == "invalid_prompt"
    assert wire.failure(Unavailable("x"))["code"] == "server_error"


def test_a_full_store_forgets_the_biggest_holders_records_not_everyones():
    """One client storing without end evicts only its own records: the least recently used of whoever holds the
    most goes first, by count (MAX_STORED_RESPONSES) and by bytes (MAX_STORED_RESPONSE_BYTES)."""
    store = ResponseStore(4, 60.0, clock=Clock())
    stored(store, "alice-1", owner="key:alice")
    for index in range(10):
        stored(store, f"mallory-{index}", owner="key:mallory")
    assert store.get("alice-1", "key:alice") and len(store) == 4
    assert [store.get(f"mallory-{index}", "key:mallory").id for index in (7, 8, 9)]
    stored(store, "alice-2", owner="key:alice")  # mallory holds the most, so mallory gives way
    assert store.get("alice-1", "key:alice") and store.get("alice-2", "key:alice")
    with pytest.raises(NotFound):
        store.get("mallory-7", "key:mallory")


def test_the_store_is_bounded_in_bytes_too():
    big = "x" * 3000
    store = ResponseStore(100, 60.0, max_bytes=10_000, clock=Clock())
    small = stored(store, "small", owner="ip:1")
    for index in range(5):
        record = StoredResponse(f"big-{index}", "ip:2", {"id": f"big-{index}", "instructions": big})
        store.add(record)
        store.finish(record)
    assert store.bytes <= 10_000 and store.get("small", "ip:1") is small
    assert len(store) == 1 + 3  # three of ip:2's 3 KB records fit beside ip:1's
    with pytest.raises(NotFound):
        store.get("big-0", "ip:2")


def test_a_finished_reply_is_weighed_again():
    store = ResponseStore(100, 60.0, max_bytes=5_000, clock=Clock())
    first = stored(store, "first", owner="ip:1")
    growing = stored(store, "growing", owner="ip:2", finished=False)
    growing.body = {"id": "growing", "output": "y" * 6000}  # its reply came in while it was generating
    store.finish(growing)
    assert store.bytes <= 5_000 and store.get("first", "ip:1") is first
    with pytest.raises(NotFound):
        store.get("growing", "ip:2")


@pytest.mark.parametrize("metadata, message", [
    ({f"k{index}": "v" for index in range(17)}, "at most 16 key-value pairs, got 17"),
    ({"k" * 65: "v"}, "keys of at most 64 characters, got one of 65"),
    ({"k": "v" * 513}, "values of at most 512 characters, got one of 513"),
])
def test_metadata_is_bounded_as_openai_bounds_it(metadata, message):
    with pytest.raises(BadRequest) as refused:
        parse(ResponseCreateRequest, {"input": "hi", "metadata": metadata})
    assert refused.value.field.startswith("metadata") and message in refused.value.message
    fine = {f"k{index}": "v" * 512 for index in range(16)}
    assert parse(ResponseCreateRequest, {"input": "hi", "metadata": fine}).metadata == fine


@pytest.mark.parametrize("field, value", [
    ("user", "u" * 513), ("instructions", "i" * ((1 << 18) + 1)), ("previous_response_id", "r" * 129),
    ("text", {"format": {"type": "json_object", "name": "n" * 65}}),
    ("text", {"format": {"type": "json_object", "description": "d" * 8193}}),
    ("tools", [{"type": "function", "name": "f", "description": "d" * 8193}]),
    ("tool_choice", {"type": "function", "name": "f" * 65}),
])
def test_every_echoed_field_is_bounded(field, value):
    with pytest.raises(BadRequest) as refused:
        parse(ResponseCreateRequest, {"input": "hi", field: value})
    assert refused.value.field.startswith(field)
