"""Tool calls read out of a reply as it comes (gateway/chat/tool_stream.py): text before a call told as text, each
call's name first and its arguments in fragments that add up to the call that the whole reply gives, at every cut of
the reply; what only begins like a call held to the end and parsed whole, as every non-streamed reply was read."""

import json
import re

import pytest

from gateway.chat.schemas import Tool
from gateway.chat.tool_stream import CallArguments, CallBegan, CallEnded, JsonRewriter, ToolCallStream, parse_calls

TOOLS = [Tool.model_validate({"type": "function", "function": {"name": name}}) for name in ("get_weather", "get_time")]
WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
WEATHER_ARGUMENTS = json.dumps({"city": "Paris", "days": 3})


def parse_before_streaming(text: str, tools: list[Tool]):
    """How a whole reply was read into calls before calls were streamed (prompts.parse_tool_calls): what a
    non-streamed reply gave then, and must give still."""
    body = re.sub(r"^\s*<tool_call>|</tool_call>\s*$", "", text.strip()).strip()
    if not body.startswith(("{", "[")):
        return None
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    calls = parsed if isinstance(parsed, list) else [parsed]
    names = {tool.function.name for tool in tools}
    result = []
    for call in calls:
        if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments", {}), dict):
            return None
        result.append((call["name"], json.dumps(call.get("arguments", {}))))
    return result or None


def told(pieces: list[str]) -> tuple[str, list, ToolCallStream]:
    """(the text told, the call events, the stream) of a reply fed in `pieces`; text is never told after a call."""
    stream, text, events = ToolCallStream(0, TOOLS), "", []
    for piece in [*pieces, None]:
        more_text, more_events = stream.feed(piece) if piece is not None else stream.finish()
        assert not (more_text and events), "text told after a call"
        text, events = text + more_text, events + more_events
    return text, events, stream


def cuts(text: str):
    """`text` whole, character by character, and in two at every place."""
    yield [text]
    yield list(text)
    for place in range(len(text) + 1):
        yield [text[:place], text[place:]]


def arguments_told(events) -> dict[int, str]:
    told_ = {}
    for event in events:
        if isinstance(event, CallArguments):
            assert told_.get(event.number) is not None, "arguments before the call's name"
            told_[event.number] += event.fragment
        elif isinstance(event, CallBegan):
            told_[event.number] = ""
    return told_


# replies that a non-streamed reply read as before: calls (bare, listed, tagged, keys in another order) and not
REPLIES = [
    WEATHER_CALL,
    '\n [{"name":"get_time","arguments":{}} ,{"name": "get_weather", "arguments": {"city": "caf\\u00e9 \\"\\/\\n😀",'
    ' "n": [1.50, -0, 1e2, true, null, {"a": []}]}}]',
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {}}',
    '{"name": "get_time", "arguments": {}}</tool_call>',
    '{"arguments": {"city": "Paris"}, "name": "get_weather"}',
    '{"name": "get_time"}',
    '{"name": "get_time", "arguments": {}, "id": 7}',
    '{"name": "set_alarm", "arguments": {}}',
    '{"name": "get_weather", "arguments": {"city": "Pa',
    '{"name": "get_weather", "arguments": {"city": "Paris"}} and more',
    '[1] is the answer', "It is sunny.", "  ", "", "a <tool_c", "x < y",
]


@pytest.mark.parametrize("reply", REPLIES)
def test_every_cut_of_a_reply_ends_as_a_whole_reply_was_read_and_tells_its_calls_whole(reply):
    expected = parse_before_streaming(reply, TOOLS)
    for pieces in cuts(reply):
        text, events, stream = told(pieces)
        assert stream.calls == expected, pieces
        if expected is None:
            assert stream.text == reply
            if not events:
                assert text == reply  # held, then told as text
            continue
        assert text == stream.text == ""
        fragments = arguments_told(events)
        assert [(event.name, fragments[event.number]) for event in events if isinstance(event, CallEnded)] \
               == expected, pieces


def test_text_before_tagged_calls_is_told_as_text_and_kept_apart_from_the_calls():
    reply = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>')
    for pieces in cuts(reply):
        text, events, stream = told(pieces)
        assert text == stream.text == "Let me look.\n", pieces
        assert stream.calls == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")] == parse_calls(
            reply[len(text):], TOOLS)
        assert arguments_told(events) == {0: '{"city": "Paris"}', 1: "{}"}
    stream = ToolCallStream(0, TOOLS)
    assert stream.feed("Let me <tool") == ("Let me ", [])  # what may be a tag waits; the rest is told at once


def test_a_call_in_tokens_is_told_name_first_then_as_its_arguments_come():
    stream, tokens = ToolCallStream(2, TOOLS), re.findall(r'\w+|\W', WEATHER_CALL)
    events = [event for token in tokens for event in stream.feed(token)[1]] + stream.finish()[1]
    assert events[0] == CallBegan(2, 0, "get_weather")
    fragments = [event.fragment for event in events if isinstance(event, CallArguments)]
    assert len(fragments) > 5 and "".join(fragments) == WEATHER_ARGUMENTS
    assert events[-1] == CallEnded(2, 0, "get_weather", WEATHER_ARGUMENTS)


def test_a_call_cut_short_ends_incomplete_and_the_reply_is_its_text():
    text, events, stream = told(['{"name": "get_weather", "arguments": {"ci', 'ty": "Pa'])
    assert events[-1] == CallEnded(0, 0, "get_weather", '{"city": "Pa', complete=False)
    assert (stream.text, stream.calls) == ('{"name": "get_weather", "arguments": {"city": "Pa', None)


@pytest.mark.parametrize("text", ['{ "a" :1.50e1,"b":[ true ,null,"\\u00e9\\/\\ud83d\\ude00 é\\t"],"c":{}, "d": -0.0}',
                                  '{"nested": {"deep": [[[]], {}], "x": false}}', '"a string"', "[]"])
def test_json_is_rewritten_as_json_dumps_writes_it_a_character_at_a_time(text):
    rewriter, written = JsonRewriter(), ""
    for char in text + " tail":
        more, used = rewriter.feed(char)
        written += more
        if rewriter.done:
            break
    assert written == json.dumps(json.loads(text)) and not rewriter.broken


@pytest.mark.parametrize("text", ['{"a" 1}', '{"a": tru}', '{"a": 01}', '{"a": "\\x"}', '{"a": "\n"}', '{1: 2}',
                                  '[1 2]', '{"a": 1]'])
def test_text_that_cannot_be_json_breaks_the_rewriter(text):
    rewriter = JsonRewriter()
    rewriter.feed(text + " ")
    assert rewriter.broken and not rewriter.done


DEEP = 5000  # past the recursion json's own decoder follows


@pytest.mark.parametrize("reply", ["[" * DEEP, "[" * DEEP + "]" * DEEP,
                                   '{"name": "get_weather", "arguments": {"a": ' + "[" * DEEP,
                                   '{"name": "get_weather", "arguments": {"a": ' + "[" * 100 + "]" * 100 + "}}"])
def test_a_reply_nested_past_any_calls_depth_is_text_and_what_was_told_ends_incomplete(reply):
    """Nested "[" raised RecursionError (a 500, a traceback in the log): now it is text; a call already told whose
    arguments nest deeper than MAX_DEPTH ends as told, incomplete, streamed or whole alike."""
    for pieces in ([reply], list(reply)):
        text, events, stream = told(pieces)
        assert stream.calls is None and stream.text == reply
        ended = [event for event in events if isinstance(event, CallEnded)]
        assert all(not event.complete for event in ended) and len(ended) == (1 if "get_weather" in reply else 0)


@pytest.mark.parametrize("opening, token", [('{"name": "', "ab"), ("{", "  "), ('{"name": "get_weather", ', " ")])
def test_a_head_that_never_closes_is_looked_at_a_bounded_number_of_characters(monkeypatch, opening, token):
    """An endless call name cost 3.5 s of CPU a reply: each token's partial match read the head again from its
    start. Now a head longer than HEAD_CHARS is held and parsed once at the end: the characters the matches look at
    stay bounded however long the reply."""
    from gateway.chat import tool_stream

    looked = []

    class Counted:
        def __init__(self, pattern):
            self.pattern = pattern

        def match(self, text, position, partial):
            looked.append(len(text) - position)
            return self.pattern.match(text, position, partial=partial)

    moves = {state: [(Counted(pattern), to) for pattern, to in moves] for state, moves in tool_stream.MOVES.items()}
    monkeypatch.setattr(tool_stream, "MOVES", moves)
    text, events, stream = told([opening] + [token] * 5000)
    assert stream.calls is None and stream.text == opening + token * 5000 and not events
    assert sum(looked) < 2 * tool_stream.HEAD_CHARS ** 2, sum(looked)
