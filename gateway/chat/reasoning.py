"""A thinking model's reply split into its reasoning and its answer, as the anchors split it (vLLM's and DeepSeek's
`reasoning_content`, Anthropic's thinking blocks, the Responses API's reasoning items, Ollama's `thinking`).

Templates that think write the reasoning between `<think>` and `</think>`:

    Qwen3          the reply itself opens the block ("<think>\\n...\\n</think>\\n\\nanswer"); enable_thinking=False
                   renders an empty, closed block in the generation prompt, and the reply is all answer
    DeepSeek-R1    the generation prompt ends with "<think>\\n": the reply begins inside the reasoning
    distills

Whether a template thinks, and whether it has the switch, is read from its text; whether the reply begins inside
the block, from the end of the rendered prompt. The split is incremental (ReasoningSplitter): a tag cut across
tokens still splits, and text that may yet become a tag is held until it is known. Whitespace at the edges of the
two parts is dropped, as Ollama drops it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

OPEN, CLOSE = "<think>", "</think>"
PROMPT_TAIL_TOKENS = 16  # enough of the prompt's end to hold its last tag and what follows it


def template_thinks(template) -> bool:
    """The chat template writes think blocks (in its generation prompt, or when it renders earlier replies)."""
    return isinstance(template, str) and (OPEN in template or CLOSE in template)


def template_switches(template) -> bool:
    """The template turns thinking on and off (Qwen3's enable_thinking)."""
    return isinstance(template, str) and "enable_thinking" in template


def template_kwargs(thinking: Optional[bool], requested: Optional[dict] = None) -> dict:
    """What the chat template is rendered with: a request's chat_template_kwargs (vLLM's), with its thinking switch
    (None: the template's default). A template that has no switch ignores it."""
    kwargs = dict(requested or {})
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    return kwargs


def requested_thinking(fields) -> Optional[bool]:
    """Whether an OpenAI chat request turns thinking on or off (None: the template's default): a top-level
    enable_thinking, else the one in chat_template_kwargs (vLLM's), else a reasoning_effort of "none" (off; any
    other effort leaves the template's default: a template has no degrees of thinking)."""
    if fields.enable_thinking is not None:
        return fields.enable_thinking
    value = (fields.chat_template_kwargs or {}).get("enable_thinking")
    if value is not None:
        return bool(value)
    return False if fields.reasoning_effort == "none" else None


@dataclass(frozen=True)
class Thinking:
    """How the replies to one prompt are read."""

    split: bool = False  # the reasoning is told apart from the answer
    opened: bool = False  # the prompt opened the think block: the reply begins inside the reasoning


NO_THINKING = Thinking()


def reply_thinking(tokenizer, prompt_ids: list[int], thinking: Optional[bool]) -> Thinking:
    """How a chat reply to `prompt_ids` is read. A template that does not think is not split; nor is one asked not
    to think that cannot be told so (its text stays as the model writes it)."""
    template = tokenizer.chat_template
    if not template_thinks(template) or (thinking is False and not template_switches(template)):
        return NO_THINKING
    tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:])
    return Thinking(split=True, opened=tail.rfind(OPEN) > tail.rfind(CLOSE))


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the beginning of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class ReasoningSplitter:
    """One reply's text, fed as it comes, split into (reasoning, answer) pieces. What is fed and not yet told is
    held: a tag's possible beginning, and whitespace that may turn out to end the reasoning."""

    START, REASONING, ANSWER = "start", "reasoning", "answer"

    def __init__(self, thinking: Thinking):
        self.split = thinking.split
        self.state = self.REASONING if thinking.opened else self.START
        self.held = ""
        self.reasoning_begun = self.answer_begun = False

    @property
    def reasoning(self) -> bool:
        """The reply is (so far) inside its reasoning."""
        return self.split and self.state == self.REASONING

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) told for this text: either may be empty, as long as something is held."""
        if not self.split:
            return "", text
        text, self.held = self.held + text, ""
        reasoning = answer = ""
        while True:
            if self.state == self.START:
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    text, self.state = stripped[len(OPEN):], self.REASONING
                    continue
                if OPEN.startswith(stripped):  # nothing yet, or what may still become "<think>"
                    self.held = text
                    return reasoning, answer
                self.state = self.ANSWER
            elif self.state == self.REASONING:
                end = text.find(CLOSE)
                if end < 0:
                    return reasoning + self._reasoning_part(text), answer
                reasoning += self._reasoning_text(text[:end].rstrip())
                text, self.state = text[end + len(CLOSE):], self.ANSWER
            else:
                return reasoning, answer + self._answer_text(text)

    def finish(self) -> tuple[str, str]:
        """What is still held, told at the reply's end: a reply cut inside its reasoning ends there."""
        held, self.held = self.held, ""
        if self.state == self.REASONING:
            return self._reasoning_text(held.rstrip()), ""
        return "", self._answer_text(held)

    def _reasoning_part(self, text: str) -> str:
        """The reasoning told of `text`, which holds no closing tag: the tag's possible beginning is held, and the
        whitespace before it (it may be the last of the reasoning)."""
        keep = _tag_prefix_at_end(text, CLOSE)
        body, tail = text[:len(text) - keep], text[len(text) - keep:]
        told = body.rstrip()
        self.held = body[len(told):] + tail
        return self._reasoning_text(told)

    def _reasoning_text(self, text: str) -> str:
        if not self.reasoning_begun:
            text = text.lstrip()
            self.reasoning_begun = bool(text)
        return text

    def _answer_text(self, text: str) -> str:
        if not self.answer_begun:
            text = text.lstrip()
            self.answer_begun = bool(text)
        return text
