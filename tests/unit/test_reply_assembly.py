"""The one reply assembly (gateway/chat/reply.py): deltas summed per choice, pieces told only for replies not held,
a held reply (tools offered) parsed into tool calls at its end, and the finish reason as clients see it."""

import json

from gateway.chat.reasoning import NO_THINKING
from gateway.chat.reply import Began, Finished, Piece, Replies
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
    assert replies.tokens == 3 and not replies.held


def test_a_reply_with_tools_offered_is_held_whole_and_parsed_into_calls():
    call = json.dumps({"name": "weather", "arguments": {"city": "Paris"}})
    plan = ScriptedPlan([(0, Delta(call[:9], 1)), (0, Delta(call[9:], 1, "stop"))], tools=[WEATHER])
    replies = Replies(plan, stats=None)
    events = list(replies.events())
    assert [type(event) for event in events] == [Began, Finished]  # no piece of a held reply is told
    reply = events[-1].reply
    assert reply.tool_calls == [("weather", json.dumps({"city": "Paris"}))]
    assert reply.ended_by == "tool_calls" and reply.finish_reason == "stop" and reply.text == call


def test_a_held_reply_that_is_text_stays_text():
    [reply] = Replies(ScriptedPlan([(0, Delta("It is sunny.", 3, "stop"))], tools=[WEATHER]), stats=None).whole()
    assert reply.tool_calls is None and reply.ended_by == "stop" and reply.text == "It is sunny."


def test_whole_replies_come_in_choice_order():
    plan = ScriptedPlan([(0, Delta("a", 1, "stop")), (1, Delta("b", 1, "stop")), (2, Delta("c", 1, "cancelled"))],
                        n=3)
    assert [(reply.index, reply.text, reply.ended_by) for reply in Replies(plan, None).whole()] == [
        (0, "a", "stop"), (1, "b", "stop"), (2, "c", "cancelled")]
