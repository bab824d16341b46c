"""A thinking model's reply split into reasoning and answer (gateway/chat/reasoning.py): at every cut of the text
across tokens the split is the same, and nothing is told that is later found to be a tag; which templates think,
and whether their reply begins inside the reasoning, read from the template and the rendered prompt; the reply
assembly (chat/reply.py) tells each piece's reasoning apart and counts the reasoning's tokens."""

import json
from types import SimpleNamespace

import pytest

from gateway.anthropic import format as anthropic_wire
from gateway.anthropic.format import MessageReply
from gateway.chat.prompts import render_chat
from gateway.chat.schemas import ChatMessage, Tool
from gateway.openai.format import ChatCompletionReplies
from gateway.chat.reasoning import (NO_THINKING, ReasoningSplitter, Thinking, reply_thinking, requested_thinking,
                                    template_kwargs)
from gateway.chat.reply import Piece, Replies
from gateway.engine.generation import Delta
from gateway.openai.schemas import ChatCompletionRequest
from tiny_model import CHAT_TEMPLATE
from thinking_model import ANSWER, PROMPT, QWEN3_TEMPLATE, R1_TEMPLATE, REASONING, REPLY, thinking_tokenizer

WEATHER = Tool.model_validate({"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}})
QWEN3 = Thinking(split=True, opened=False)
R1 = Thinking(split=True, opened=True)
R1_REPLY = REPLY[len("<think>"):]  # the generation prompt opened the block


def split_told(thinking: Thinking, pieces: list[str]) -> tuple[str, str]:
    """What the splitter tells, fed `pieces`: at every step, the reasoning and answer told so far must begin the
    expected ones (nothing told is taken back)."""
    splitter, reasoning, answer = ReasoningSplitter(thinking), "", ""
    for piece in pieces:
        more_reasoning, more_answer = splitter.feed(piece)
        reasoning, answer = reasoning + more_reasoning, answer + more_answer
        yield reasoning, answer
    last_reasoning, last_answer = splitter.finish()
    yield reasoning + last_reasoning, answer + last_answer


def assert_split(thinking: Thinking, pieces: list[str], reasoning: str, answer: str) -> None:
    told = list(split_told(thinking, pieces))
    for told_reasoning, told_answer in told:
        assert reasoning.startswith(told_reasoning) and answer.startswith(told_answer), (pieces, told)
    assert told[-1] == (reasoning, answer), pieces


def every_cut(text: str):
    """`text` in two pieces at every position, in three at every pair of positions, and character by character."""
    yield [text]
    yield list(text)
    for first in range(len(text) + 1):
        yield [text[:first], text[first:]]
        for second in range(first, len(text) + 1):
            yield [text[:first], text[first:second], text[second:]]


@pytest.mark.parametrize("thinking, text", [(QWEN3, REPLY), (R1, R1_REPLY)], ids=["qwen3", "r1"])
def test_every_cut_of_the_tags_splits_alike(thinking, text):
    for pieces in every_cut(text):
        assert_split(thinking, pieces, REASONING, ANSWER)


def test_text_that_only_begins_like_a_tag_is_held_until_known():
    splitter = ReasoningSplitter(QWEN3)
    assert splitter.feed("<thi") == ("", "")  # may still be "<think>"
    assert splitter.feed("s is text") == ("", "<this is text")
    splitter = ReasoningSplitter(R1)
    assert splitter.feed("a </th") == ("a", "")
    assert splitter.feed("ree> b") == (" </three> b", "")


def test_a_reply_that_does_not_think_is_all_answer():
    assert_split(QWEN3, ["Hello", " there"], "", "Hello there")
    assert_split(QWEN3, ["\n", "\nHello"], "", "Hello")


def test_a_reply_cut_inside_its_reasoning_is_all_reasoning():
    assert_split(QWEN3, ["<think>\nthe user", " </thi"], "the user </thi", "")
    assert_split(R1, ["the user greets\n"], "the user greets", "")


def test_a_reply_not_split_stays_as_it_is():
    assert_split(NO_THINKING, ["<think>\nx\n</think>", "\n\nHello"], "", "<think>\nx\n</think>\n\nHello")


def test_which_templates_think_and_where_the_reply_begins():
    messages = [{"role": "user", "content": PROMPT}]

    def thinking_of(template, enable_thinking):
        tokenizer = thinking_tokenizer(template)
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                               **template_kwargs(enable_thinking))
        return reply_thinking(tokenizer, tokenizer.encode(prompt, add_special_tokens=False), enable_thinking)

    assert thinking_of(QWEN3_TEMPLATE, None) == thinking_of(QWEN3_TEMPLATE, True) == QWEN3
    assert thinking_of(QWEN3_TEMPLATE, False) == QWEN3  # an empty block closed in the prompt: the reply is answer
    assert thinking_of(R1_TEMPLATE, None) == R1
    assert thinking_of(R1_TEMPLATE, False) == NO_THINKING  # no switch: the model thinks anyway, its text as it is
    assert thinking_of(CHAT_TEMPLATE, None) == thinking_of(CHAT_TEMPLATE, True) == NO_THINKING


def test_template_variables_reach_the_template_but_never_override_the_rendering():
    tokenizer = thinking_tokenizer()
    messages = [ChatMessage(role="user", content=PROMPT)]
    rendered = render_chat(tokenizer, messages, None, template_kwargs={"add_generation_prompt": False,
                                                                       "tokenize": True, "enable_thinking": False})
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_request_turns_thinking_on_or_off():
    def requested(**fields):
        return requested_thinking(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields))

    assert requested() is None and requested(reasoning_effort="high") is None
    assert requested(reasoning_effort="none") is False
    assert requested(chat_template_kwargs={"enable_thinking": False}) is False
    assert requested(enable_thinking=True, chat_template_kwargs={"enable_thinking": False}) is True
    assert template_kwargs(False, {"custom": 1}) == {"custom": 1, "enable_thinking": False}


class ThinkingPlan:
    """Stands in for chat.plan.Plan: scripted deltas of one choice, for a prompt that opened its think block."""

    n, tools, prompt_ids, thinking = 1, None, [1, 2, 3], R1

    def __init__(self, deltas):
        self.deltas = deltas

    def run(self, cancelled, stats):
        yield from ((0, delta) for delta in self.deltas)


def test_the_reply_assembly_tells_reasoning_apart_and_counts_its_tokens():
    deltas = [Delta("the user", 2), Delta(" greets\n</", 2), Delta("think>\n\nHello", 3), Delta(" there", 2, "stop")]
    replies = Replies(ThinkingPlan(deltas), stats=None)
    pieces = [(event.reasoning, event.text) for event in replies.events() if isinstance(event, Piece)]
    assert pieces == [("the user", ""), (" greets", ""), ("", "Hello"), ("", " there")]
    [reply] = replies.replies.values()
    assert (reply.reasoning, reply.text, reply.tokens, reply.reasoning_tokens) == (REASONING, ANSWER, 9, 7)
    assert replies.reasoning_tokens == 7


class ToolPlan(ThinkingPlan):
    """A thinking reply with tools offered: its reasoning told, then its call."""

    tools, cached_tokens, model = [WEATHER], 0, SimpleNamespace(name="thinker", tokenizer=None)


CALL = json.dumps({"name": "weather", "arguments": {"city": "Paris"}})
THINKING_CALL = [Delta("the user greets\n</think>\n\n", 4), Delta(CALL, 5, "stop")]


def test_a_reply_with_tools_tells_its_reasoning_before_its_call_in_openai_chunks():
    chunks = list(ChatCompletionReplies(ToolPlan(THINKING_CALL), None, False, None).chunks(lambda: False))
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert deltas[1] == {"reasoning_content": REASONING} and deltas[2]["tool_calls"][0]["function"]["name"] == "weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_anthropic_blocks_are_thinking_then_the_answer_or_the_call():
    events = list(MessageReply(ToolPlan(THINKING_CALL), None).events(lambda: False))
    starts = [event["content_block"]["type"] for event in events if event["type"] == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    signed = [event["delta"] for event in events if event["type"] == "content_block_delta" and event["index"] == 0]
    assert signed == [{"type": "thinking_delta", "thinking": REASONING},
                      {"type": "signature_delta", "signature": anthropic_wire.signature(REASONING)}]
    plan = ToolPlan([Delta("the user greets\n</think>\n\nHello", 6), Delta(" there", 1, "stop")])
    plan.tools = None
    streamed = list(MessageReply(plan, None).events(lambda: False))
    assert [(event["type"], event.get("index")) for event in streamed if "index" in event] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1)]
    content = MessageReply(plan, None).finish(Replies(plan, None).whole()[0])[0]
    assert content == [anthropic_wire.thinking_block(REASONING), {"type": "text", "text": ANSWER}]
