"""The one reply assembly (gateway/chat/reply.py): deltas summed per choice, a reply with tools offered told as text
and calls as they are written (chat/tool_stream.py), and the finish reason as clients see it."""

import json

from gateway.chat.reasoning import NO_THINKING
from gateway.chat.reply import Began, CallArguments, CallBegan, CallEnded, Finished, Piece, Replies
from gateway.chat.schemas import Tool
from gateway.engine.generation import Delta, TokenLogprob

WEATHER = Tool.model_validate({"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}})


class ScriptedPlan:
    """Stands in for chat.plan.Plan: scripted (choice index, delta) pairs."""

    thinking = NO_THINKING  # a model that does not think: its text all answer

    def __init__(self, deltas, n=1, tools=None):
        self.deltas, self.n, self.tools = deltas, n, tools
        self.prompt_ids = [1, 2, 3]

    def run(self, cancelled, stats):
        yield from self.deltas


def test_two_choices_are_summed_apart_and_told_in_order():
    plan = ScriptedPlan([(0, Delta("Hel", 1, logprobs=(TokenLogprob(7, -0.5),))), (0, Delta("lo", 1, "length")),
                         (1, Delta("Bye", 1, "stop", stop_sequence="\n"))], n=2)
    replies = Replies(plan, stats=None)
    events = list(replies.events())
    assert [type(event) for event in events] == [Began, Piece, Piece, Finished, Began, Piece, Finished]
    first, second = events[3].reply, events[6].reply
    assert (first.text, first.tokens, first.ended_by, first.token_ids) == ("Hello", 2, "length", [7])
    assert (second.text, second.ended_by, second.stop_sequence) == ("Bye", "stop", "\n")
    assert replies.tokens == 3


def test_a_reply_with_tools_offered_tells_its_call_as_it_is_written():
    call = json.dumps({"name": "weather", "arguments": {"city": "Paris"}})
    cut = call.index("Par")
    plan = ScriptedPlan([(0, Delta(call[:9], 1)), (0, Delta(call[9:cut], 1)), (0, Delta(call[cut:], 1, "stop"))],
                        tools=[WEATHER])
    events = list(Replies(plan, stats=None).events())
    assert [type(event) for event in events] == [Began, Piece, Piece, CallBegan, CallArguments, Piece, CallArguments,
                                                 CallEnded, Finished]
    assert events[3].name == "weather" and [events[4].fragment, events[6].fragment] == ['{"city": "', 'Paris"}']
    reply = events[-1].reply
    assert reply.tool_calls == [("weather", json.dumps({"city": "Paris"}))] == [(events[7].name, events[7].arguments)]
    assert reply.ended_by == "tool_calls" and reply.finish_reason == "stop" and reply.text == ""


def test_text_before_a_tagged_call_is_told_as_text():
    deltas = [(0, Delta("Let me look.\n<tool", 4)), (0, Delta('_call>{"name": "weather", "arguments": {}}', 9, "stop"))]
    events = list(Replies(ScriptedPlan(deltas, tools=[WEATHER]), stats=None).events())
    assert [event.text for event in events if isinstance(event, Piece)] == ["Let me look.\n", ""]
    reply = events[-1].reply
    assert (reply.text, reply.tool_calls) == ("Let me look.\n", [("weather", "{}")])


def test_a_reply_with_tools_offered_that_is_text_stays_text():
    [reply] = Replies(ScriptedPlan([(0, Delta("It is sunny.", 3, "stop"))], tools=[WEATHER]), stats=None).whole()
    assert reply.tool_calls is None and reply.ended_by == "stop" and reply.text == "It is sunny."


def test_whole_replies_come_in_choice_order():
    plan = ScriptedPlan([(0, Delta("a", 1, "stop")), (1, Delta("b", 1, "stop")), (2, Delta("c", 1, "cancelled"))],
                        n=3)
    assert [(reply.index, reply.text, reply.ended_by) for reply in Replies(plan, None).whole()] == [
        (0, "a", "stop"), (1, "b", "stop"), (2, "c", "cancelled")]
