"""Tool calls read out of a reply as it comes, so that every dialect streams them as vLLM and llama.cpp's server do:
the text before a call as text, then each call as its start (its name), fragments of its arguments, and its end.

What a reply with tools offered may be (prompts.TOOLS_INSTRUCTION asks for the bare JSON and the grammar of a forced
call, engine/grammar.tool_call_spec, writes it; templates that know tools, Hermes' and Qwen's, wrap calls in tags):

    text                                          no call: all of it streamed as text
    {"name": N, "arguments": {...}}               a call: the reply's first non-blank character is its "{"
    [{"name": N, "arguments": {...}}, ...]        several calls (parallel_tool_calls)
    text <tool_call>{...}</tool_call> <tool_call>[...]</tool_call>
                                                  text, then calls in tags (the last closing tag may be missing)

A call is told as it is written once its head `{"name": "<a tool offered>", "arguments": {` has come. Its arguments
are re-written as json.dumps writes them (", " and ": " between items, ASCII escapes, numbers as Python reads them)
so that the fragments add up to the arguments that parsing the whole reply gives (`parse_calls`): the same call,
streamed or not (but for an object that names a key twice: its fragments hold both, json.loads keeps the last).
Whatever else begins like a call (keys in another order, a tool not offered, another key first) is held to the
reply's end and parsed whole, as every call was before: told then as whole calls, or as text.

The reply's outcome (`text`, `calls` once finished) is always that of parsing it whole: the text before its calls and
the calls, or all of it text when its call part does not parse. Only a call already told that turns out broken (cut
by max_tokens, junk after it) is told otherwise: the stream has told it, so it ends as it stands (CallEnded with
complete False when its arguments never closed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Union

import regex  # for partial matches: whether the text so far can still become a call's head

from gateway.chat.schemas import Tool

TAG, END_TAG = "<tool_call>", "</tool_call>"
# A call's head that has not come whole within this many characters is no call to tell as it comes (a tool's name
# is at most 64): it is held to the end and parsed whole, so that a reply that keeps a head open (an endless name,
# endless blanks) costs one bounded look per token, not one over all it wrote.
HEAD_CHARS = 256
MAX_DEPTH = 64  # of a call's arguments: deeper is no call (json's own decoder recurses, and tells it as an error)


@dataclass(frozen=True)
class CallBegan:
    index: int  # the choice
    number: int  # the call's place among the reply's calls, from 0
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    number: int
    fragment: str  # of the arguments' JSON text


@dataclass(frozen=True)
class CallEnded:
    index: int
    number: int
    name: str
    arguments: str  # all of them, as told
    complete: bool = True  # False: the reply ended before the arguments closed


CallEvent = Union[CallBegan, CallArguments, CallEnded]

# ------------------------------------------------------------------------------------------ a reply parsed whole

BLANK = regex.compile(r"\s*")
DECODER = json.JSONDecoder()


def parse_calls(segment: str, tools: list[Tool]) -> Optional[list[tuple[str, str]]]:
    """(name, arguments as json.dumps writes them) of each call in a reply's call part, or None when it is not calls:
    JSON blocks, each may open with <tool_call> (every block after the first must) and close with </tool_call>."""
    names = {tool.function.name for tool in tools}
    calls, position = [], BLANK.match(segment).end()
    while position < len(segment):
        if segment.startswith(TAG, position):
            position = BLANK.match(segment, position + len(TAG)).end()
        elif calls:
            return None
        try:
            value, position = DECODER.raw_decode(segment, position)
        except (ValueError, RecursionError):  # not JSON, or nested past what the decoder follows
            return None
        block = calls_of(value, names)
        if block is None:
            return None
        calls += block
        position = BLANK.match(segment, position).end()
        if segment.startswith(END_TAG, position):
            position = BLANK.match(segment, position + len(END_TAG)).end()
    return calls or None


def calls_of(value, names: set[str]) -> Optional[list[tuple[str, str]]]:
    """A JSON block's calls: one {"name", "arguments"} object, or a list of them."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names \
                or not isinstance(item.get("arguments", {}), dict):
            return None
        calls.append((item["name"], json.dumps(item.get("arguments", {}))))
    return calls or None


# ------------------------------------------------------------------------------------------ a reply as it comes


@dataclass
class OpenCall:
    """A call being told: its name, its arguments read so far and what they were written as."""

    name: str
    rewriter: "JsonRewriter" = field(default_factory=lambda: JsonRewriter())
    arguments: str = ""


HEAD = r'\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")\s*,\s*"arguments"\s*:\s*\{'
# what may come next in each state of the call part, and the state each leads to ("call": a call's head, told)
MOVES = {
    "block": [(regex.compile(r"\s*(?:<tool_call>\s*)?(\[\s*)?" + HEAD), "call")],
    "element": [(regex.compile(r"\s*,\s*()" + HEAD), "call"), (regex.compile(r"\s*\]"), "json_end")],
    "object_end": [(regex.compile(r"\s*\}"), "element")],
    "json_end": [(regex.compile(r"\s*(?:</tool_call>\s*)?<tool_call>\s*(\[\s*)?" + HEAD), "call"),
                 (regex.compile(r"\s*</tool_call>"), "between")],
    "between": [(regex.compile(r"\s*<tool_call>\s*(\[\s*)?" + HEAD), "call")],
}


class ToolCallStream:
    """One choice's answer text fed as it comes: `feed` and `finish` give the text to tell and the call events, the text
    always before the calls. States: "start" (blanks so far), "text", then the call part: "block", "arguments" (a
    call's, told as they come), "object_end", "element" (in a list), "json_end", "between" (tagged blocks), and
    "unsure" (held to the end, then parsed whole)."""

    def __init__(self, index: int, tools: list[Tool]):
        self.index, self.tools, self.names = index, tools, {tool.function.name for tool in tools}
        self.raw, self.position = "", 0  # all the text fed, and how far it is read
        self.told, self.shown = 0, 0  # how far it is text to tell, and how far that was told
        self.state, self.segment = "start", None  # where the call part begins, once it has
        self.in_list, self.number = False, 0  # in a JSON list of calls; how many calls were told
        self.call: Optional[OpenCall] = None
        self.text: Optional[str] = None  # the outcome, once finished: the text, and the calls (None: it is text)
        self.calls: Optional[list[tuple[str, str]]] = None

    def feed(self, text: str) -> tuple[str, list[CallEvent]]:
        """More of the answer: (the text to tell now, the call events it completes)."""
        self.raw += text
        events: list[CallEvent] = []
        while self.step(events):
            pass
        return self.new_text(), events

    def finish(self) -> tuple[str, list[CallEvent]]:
        """The reply ended: what is held is told (text, or calls parsed whole); the outcome is set."""
        events: list[CallEvent] = []
        if self.segment is None:
            self.told = len(self.raw)
            self.text, self.calls = self.raw, None
            return self.new_text(), events
        calls = parse_calls(self.raw[self.segment:], self.tools)
        if self.call is not None:  # its arguments never closed (or nested too deep): it ends as told, the rest text
            events.append(CallEnded(self.index, self.number, self.call.name, self.call.arguments, complete=False))
            calls = None
        if calls is None:
            self.text = self.raw
            if self.number == 0 and self.call is None:  # nothing told of it: it is text
                self.told = len(self.raw)
        else:
            self.text, self.calls = self.raw[:self.segment], calls
            for number, (name, arguments) in enumerate(calls[self.number:], start=self.number):
                events += [CallBegan(self.index, number, name), CallArguments(self.index, number, arguments),
                           CallEnded(self.index, number, name, arguments)]
        return self.new_text(), events

    def new_text(self) -> str:
        """The text told since last asked."""
        text, self.shown = self.raw[self.shown:self.told], self.told
        return text

    def step(self, events: list[CallEvent]) -> bool:
        """One move on the text not yet read; False when it must wait for more."""
        if self.state in ("start", "text"):
            return self.read_text()
        if self.state == "arguments":
            return self.read_arguments(events)
        if self.state == "unsure":
            return False
        return self.move(events)

    def read_text(self) -> bool:
        """Text is told up to a <tool_call> tag (or a call's first character, when nothing but blanks came before)."""
        rest = self.raw[self.position:]
        if self.state == "start":
            stripped = rest.lstrip()
            if not stripped or (TAG.startswith(stripped) and stripped != TAG):
                return False  # blanks, or what may be a tag: not known yet
            if stripped[0] in "{[" or stripped.startswith(TAG):
                return self.begin_calls(self.position)
            self.state = "text"
        found = rest.find(TAG)
        if found >= 0:
            self.told = self.position + found
            return self.begin_calls(self.position + found)
        self.told = self.position = len(self.raw) - partial_tag_length(rest)
        return False

    def begin_calls(self, at: int) -> bool:
        self.segment, self.position, self.state = at, at, "block"
        return True

    def move(self, events: list[CallEvent]) -> bool:
        """The call part between calls' arguments: the state's first move that the text makes whole; to wait while
        the text may still make one, else "unsure"."""
        waiting = False
        for pattern, state in MOVES[self.state]:
            found = pattern.match(self.raw, self.position, partial=True)
            if found is None:
                continue
            if found.partial:
                waiting = waiting or len(self.raw) - self.position <= HEAD_CHARS
                continue
            self.position = found.end()
            if state != "call":
                self.state = "json_end" if state == "element" and not self.in_list else state
                return True
            return self.begin_call(found, events)
        if not waiting:
            self.state = "unsure"
        return False

    def begin_call(self, head, events: list[CallEvent]) -> bool:
        """A call's head came: `{"name": ..., "arguments": {`. Told if it names a tool offered."""
        try:
            name = json.loads(head.group(2))
        except ValueError:
            name = None
        if name not in self.names:
            self.state = "unsure"
            return False
        self.in_list = head.group(1) is not None  # "[" opened a list here, "" is a list's next element
        events.append(CallBegan(self.index, self.number, name))
        self.position -= 1  # the arguments' "{" is theirs to read
        self.call, self.state = OpenCall(name), "arguments"
        return True

    def read_arguments(self, events: list[CallEvent]) -> bool:
        """The open call's arguments, as far as they came; once they close, the call ends."""
        call = self.call
        written, used = call.rewriter.feed(self.raw[self.position:])
        self.position += used
        if written:
            call.arguments += written
            events.append(CallArguments(self.index, self.number, written))
        if call.rewriter.broken:
            self.state = "unsure"  # told as far as it went: the reply's end closes it
            return False
        if call.rewriter.done:
            events.append(CallEnded(self.index, self.number, call.name, call.arguments))
            self.call, self.number, self.state = None, self.number + 1, "object_end"
            return True
        return False


def partial_tag_length(text: str) -> int:
    """How many of `text`'s last characters may begin a <tool_call> tag (held until the next text tells)."""
    for length in range(min(len(TAG) - 1, len(text)), 0, -1):
        if TAG.startswith(text[-length:]):
            return length
    return 0


# ------------------------------------------------------------------------------------------ arguments re-written

VALUE, VALUE_OR_CLOSE, KEY, KEY_OR_CLOSE, COLON, NEXT = "value", "value or close", "key", "key or close", ":", "next"
SCALAR_CHARS = frozenset("0123456789+-.eEInfinityNatrueflsn")  # numbers, true, false, null (and Python's -Infinity)


class JsonRewriter:
    """One JSON value read as it comes and written as json.dumps writes it, a character at a time (a number or a literal
    once it ends); `done` once the value has closed, `broken` once the text cannot be JSON."""

    def __init__(self):
        self.closers: list[str] = []  # of the containers open: "}" or "]"
        self.expect = VALUE
        self.in_string, self.key, self.escape, self.scalar = False, False, None, ""
        self.done = self.broken = False

    def feed(self, text: str) -> tuple[str, int]:
        """(what `text` writes, how many of its characters were read: none past the value's end)."""
        written = []
        for count, char in enumerate(text, start=1):
            written.append(self.read(char))
            if self.done or self.broken:
                return "".join(written), count
        return "".join(written), len(text)

    def read(self, char: str) -> str:
        if self.in_string:
            return self.string_char(char)
        if self.scalar:
            if char in SCALAR_CHARS:
                self.scalar += char
                return ""
            written = self.end_scalar()
            return "" if self.broken else written + self.structure(char)
        return self.structure(char)

    def structure(self, char: str) -> str:
        expect = self.expect
        if char in " \t\n\r":
            return ""
        if char == '"' and expect != COLON and expect != NEXT:
            self.in_string, self.key = True, expect in (KEY, KEY_OR_CLOSE)
            return char
        if expect in (VALUE, VALUE_OR_CLOSE) and char in "{[" and len(self.closers) < MAX_DEPTH:
            self.closers.append("}" if char == "{" else "]")
            self.expect = KEY_OR_CLOSE if char == "{" else VALUE_OR_CLOSE
            return char
        if expect in (VALUE, VALUE_OR_CLOSE) and char in "-0123456789tfn":
            self.scalar = char
            return ""
        if char == ":" and expect == COLON:
            self.expect = VALUE
            return ": "
        if char == "," and expect == NEXT:
            self.expect = KEY if self.closers[-1] == "}" else VALUE
            return ", "
        if self.closers and char == self.closers[-1] and expect in (NEXT, KEY_OR_CLOSE, VALUE_OR_CLOSE):
            self.closers.pop()
            self.value_ended()
            return char
        self.broken = True
        return ""

    def string_char(self, char: str) -> str:
        if self.escape is not None:
            self.escape += char
            if self.escape[1] == "u" and len(self.escape) < 6:
                return ""
            return self.end_escape()
        if char == "\\":
            self.escape = char
            return ""
        if char == '"':
            self.in_string = False
            if self.key:
                self.expect = COLON
            else:
                self.value_ended()
            return char
        if char < " ":  # JSON's strings hold no raw control characters
            self.broken = True
            return ""
        return json.dumps(char)[1:-1]

    def end_escape(self) -> str:
        escape, self.escape = self.escape, None
        try:
            return json.dumps(json.loads(f'"{escape}"'))[1:-1]
        except ValueError:
            self.broken = True
            return ""

    def end_scalar(self) -> str:
        scalar, self.scalar = self.scalar, ""
        try:
            value = json.loads(scalar)
        except ValueError:
            self.broken = True
            return ""
        self.value_ended()
        return json.dumps(value)

    def value_ended(self) -> None:
        self.expect = NEXT
        self.done = not self.closers
