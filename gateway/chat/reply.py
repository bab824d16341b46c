"""The one reply assembly of every chat-shaped dialect: a plan's deltas summed into replies, one per choice.

A reply is text, tool calls, or text then calls. With tools offered, each choice's answer goes through a
ToolCallStream (tool_stream.py): its text is told as text and each call as it is written. Each dialect only formats
what it is told:

    Began(index)      a choice's first delta came (OpenAI's role chunk)
    Piece(index, d)   a delta, and what it tells: answer text and reasoning text (reasoning.py splits a thinking
                      model's reply; the dialect decides what is worth a frame); a call's text is not in it
    CallBegan         a call's start: its name (tool_stream.py); then CallArguments, fragments of its arguments'
    CallArguments     JSON text, and CallEnded: all of it, and whether it closed (always after the delta's Piece)
    CallEnded
    Finished(reply)   a choice ended: its text and tool calls, finish reason, stop sequence, tokens and logprobs

    replies = Replies(plan, stats)
    for event in replies.events(cancelled): ...      # streamed
    for reply in replies.whole(): ...                # one body
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Union

from gateway.chat.plan import Plan
from gateway.chat.reasoning import ReasoningSplitter
from gateway.chat.tool_stream import CallArguments, CallBegan, CallEnded, CallEvent, ToolCallStream
from gateway.engine.generation import Delta, TokenLogprob


@dataclass
class Reply:
    """What one choice's deltas add up to."""

    index: int
    text: str = ""  # the answer (all of the reply, unless it is a thinking model's); with calls, the text before them
    finish_reason: str = "stop"  # the engine's: "stop", "length" or "cancelled"
    stop_sequence: Optional[str] = None  # which of the request's stop sequences ended it
    tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_calls: Optional[list[tuple[str, str]]] = None  # (name, arguments as JSON text) when the reply is calls
    reasoning: str = ""  # a thinking model's reasoning, apart from its answer
    reasoning_tokens: int = 0

    def add(self, delta: Delta, reasoning: str, text: str, thought: bool) -> None:
        """`delta` told as `reasoning` and `text`; `thought`: its tokens were (some of) the reasoning's."""
        self.text += text
        self.reasoning += reasoning
        self.tokens += delta.token_count
        self.reasoning_tokens += delta.token_count if thought else 0
        self.logprobs += delta.logprobs
        if delta.finish_reason:
            self.finish_reason, self.stop_sequence = delta.finish_reason, delta.stop_sequence

    @property
    def ended_by(self) -> str:
        """The finish reason as the client sees it: "tool_calls" for a reply that is calls."""
        return "tool_calls" if self.tool_calls else self.finish_reason

    @property
    def token_ids(self) -> list[int]:
        """The generated tokens (known when the request asked for logprobs)."""
        return [item.token_id for item in self.logprobs]


@dataclass(frozen=True)
class Began:
    index: int


@dataclass(frozen=True)
class Piece:
    index: int
    delta: Delta
    text: str = ""  # of the answer
    reasoning: str = ""


@dataclass(frozen=True)
class Finished:
    reply: Reply


ReplyEvent = Union[Began, Piece, CallBegan, CallArguments, CallEnded, Finished]


class Replies:
    """The replies of one plan, as events while they come, or whole."""

    def __init__(self, plan: Plan, stats):
        self.plan, self.stats = plan, stats
        self.replies: dict[int, Reply] = {}
        self.splitters: dict[int, ReasoningSplitter] = {}
        self.calls: dict[int, ToolCallStream] = {}  # with tools offered: each choice's calls read as they come

    @property
    def tokens(self) -> int:
        """Tokens generated so far, over every choice."""
        return sum(reply.tokens for reply in self.replies.values())

    @property
    def reasoning_tokens(self) -> Optional[int]:
        """Tokens of reasoning so far, over every choice; None when the replies are not split (reasoning.py)."""
        if not self.plan.thinking.split:
            return None
        return sum(reply.reasoning_tokens for reply in self.replies.values())

    def events(self, cancelled: Callable[[], bool] = lambda: False) -> Iterator[ReplyEvent]:
        for index, delta in self.plan.run(cancelled, self.stats):
            reply = self.replies.get(index)
            if reply is None:
                reply = self.replies[index] = Reply(index)
                self.splitters[index] = ReasoningSplitter(self.plan.thinking)
                if self.plan.tools:
                    self.calls[index] = ToolCallStream(index, self.plan.tools)
                yield Began(index)
            reasoning, text = self.split(index, delta, reply)
            text, calls = self.read_calls(index, text, delta.finish_reason is not None, reply)
            yield Piece(index, delta, text, reasoning)
            yield from calls
            if delta.finish_reason:
                yield Finished(reply)

    def read_calls(self, index: int, text: str, last: bool, reply: Reply) -> tuple[str, list[CallEvent]]:
        """(the text to tell, the call events) of a delta's answer `text`; at the reply's end, its text and calls as
        parsing it whole gives them."""
        stream = self.calls.get(index)
        if stream is None:
            return text, []
        text, calls = stream.feed(text)
        if last:
            last_text, last_calls = stream.finish()
            text, calls = text + last_text, calls + last_calls
            reply.text, reply.tool_calls = stream.text, stream.calls
        return text, calls

    def split(self, index: int, delta: Delta, reply: Reply) -> tuple[str, str]:
        """(reasoning, answer) that `delta` tells, added to its reply; at the reply's end, all that was held."""
        splitter = self.splitters[index]
        thinking_before = splitter.reasoning
        reasoning, text = splitter.feed(delta.text)
        if delta.finish_reason:
            last_reasoning, last_text = splitter.finish()
            reasoning, text = reasoning + last_reasoning, text + last_text
        reply.add(delta, reasoning, text, thinking_before or splitter.reasoning)
        return reasoning, text

    def whole(self) -> list[Reply]:
        """Every choice's reply, in order, once all have ended."""
        for _ in self.events():
            pass
        return [self.replies.get(index, Reply(index)) for index in range(self.plan.n)]
