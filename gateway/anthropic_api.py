"""Anthropic's Messages API under /v1: a thin translator to the engine, as openai_api.py is for OpenAI's API.

    POST /v1/messages               a message, or (stream: true) its events over SSE
    POST /v1/messages/count_tokens  {"input_tokens": n}: the prompt that /v1/messages would run for this body

A request is read into schemas/anthropic.py's shapes and turned once into the shapes the shared modules take:
chat messages for prompts.render_chat (tool_use blocks as an assistant's tool calls, tool_result blocks as tool
messages), OpenAI-style tools and a tool choice for the tool-call grammar, and sampling fields for
openai_choices.plan_generation, which builds the GenerationRequest for Engine.generate. Errors take Anthropic's
envelope (anthropic_format.error_body) through create_app's one error handler, which asks `speaks_anthropic`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator, Optional

from flask import Blueprint, jsonify, request

from gateway import anthropic_format as wire
from gateway.current_engine import get_engine
from gateway.engine import Delta, ServedModel
from gateway.errors import BadRequest
from gateway.json_bodies import json_body
from gateway.openai_choices import plan_generation
from gateway.prompts import parse_tool_calls, render_chat
from gateway.schemas import (
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    NamedToolChoice,
    SamplingFields,
    Tool,
    ToolCall,
)
from gateway.schemas.anthropic import (
    AnthropicContentBlock,
    AnthropicCountTokensRequest,
    AnthropicMessage,
    AnthropicMessagesRequest,
)
from gateway.sse import event_stream

blueprint = Blueprint("anthropic", __name__)
PREFIX = "/v1"
MESSAGES_PATH = PREFIX + "/messages"


def speaks_anthropic() -> bool:
    """Whether this request's errors take Anthropic's envelope: its routes, unknown paths under /v1/messages, and
    unknown paths asked for by Anthropic's clients (they send anthropic-version with every request)."""
    if request.blueprint is not None:
        return request.blueprint.startswith("anthropic")
    path = request.path
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/") or "anthropic-version" in request.headers


@blueprint.post("/messages")
def messages():
    fields = json_body(AnthropicMessagesRequest)
    engine = get_engine()
    model = engine.model(fields.model)
    prompt_ids, tool_choice = prompt_of(model, fields)
    plan = plan_generation(engine, model, sampling_fields(fields), prompt_ids, "messages", tool_choice=tool_choice)
    reply = MessageReply(model, tool_choice[1], len(prompt_ids), plan, engine.stats.begin())
    if not fields.stream:
        return jsonify(reply.message())
    return event_stream(reply.events, wire.error_body, named=True)


@blueprint.post("/messages/count_tokens")
def count_tokens():
    fields = json_body(AnthropicCountTokensRequest)
    prompt_ids, _ = prompt_of(get_engine().model(fields.model), fields)
    return jsonify(input_tokens=len(prompt_ids))


# ------------------------------------------------------------------------------------------ the request, translated


def prompt_of(model: ServedModel, fields: AnthropicCountTokensRequest) -> tuple[list[int], tuple]:
    """The prompt's token ids, and the tool choice as plan_generation takes it: (choice, tools or None, parallel).
    A conversation that ends with an assistant turn is a prefilled reply: the model goes on from its text."""
    tool_choice = tool_choice_of(fields)
    prefilled = fields.messages[-1].role == "assistant"
    text = render_chat(model.tokenizer, chat_messages(fields), tool_choice[1], continue_final=prefilled)
    return model.encode(text, at_start=False), tool_choice  # the template wrote any special tokens itself


def tool_choice_of(fields: AnthropicCountTokensRequest) -> tuple:
    """Anthropic's tool choice in OpenAI's terms: auto -> "auto", any -> "required", tool -> that function, none
    (or no tools) -> "none", when the tools are not even shown to the model. By default "auto" with tools."""
    choice = fields.tool_choice
    kind = choice.type if choice is not None else ("auto" if fields.tools else "none")
    if kind in ("any", "tool") and not fields.tools:
        raise BadRequest(f"tool_choice: {kind} needs tools", field="tool_choice")
    if kind == "none":
        return "none", None, False
    tools = [Tool(type="function", function=FunctionDefinition(name=tool.name, description=tool.description,
                                                                parameters=tool.input_schema))
             for tool in fields.tools]
    named = NamedToolChoice(type="function", function={"name": choice.name}) if kind == "tool" else None
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    return {"auto": "auto", "any": "required"}.get(kind, named), tools, parallel


def sampling_fields(fields: AnthropicMessagesRequest) -> SamplingFields:
    """The sampling settings in the shape openai_params reads, once, into SamplingParams and the token budget."""
    return SamplingFields(model=fields.model, temperature=fields.temperature, top_p=fields.top_p, top_k=fields.top_k,
                          max_tokens=fields.max_tokens, stop=list(fields.stop_sequences or []))


def chat_messages(fields: AnthropicCountTokensRequest) -> list[ChatMessage]:
    messages = []
    if fields.system:
        messages.append(ChatMessage(role="system", content="\n".join(block.text for block in fields.system)))
    for index, turn in enumerate(fields.messages):
        messages.extend(assistant_turn(turn, index) if turn.role == "assistant" else user_turn(turn, index))
    return messages


def assistant_turn(turn: AnthropicMessage, index: int) -> list[ChatMessage]:
    """An assistant turn is one message: its text, and its tool_use blocks as tool calls."""
    texts, calls = [], []
    for number, block in enumerate(turn.content):
        if block.type == "tool_result":
            raise misplaced(index, number, "tool_result blocks belong in user turns")
        if block.type == "text":
            texts.append(block.text)
        else:
            calls.append(ToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=json.dumps(block.input))))
    return [ChatMessage(role="assistant", content="\n".join(texts), tool_calls=calls or None)]


def user_turn(turn: AnthropicMessage, index: int) -> list[ChatMessage]:
    """A user turn in order: each tool_result block a tool message (as OpenAI's tool messages are rendered), the
    text between them a user message."""
    messages, texts = [], []
    for number, block in enumerate(turn.content):
        if block.type == "tool_use":
            raise misplaced(index, number, "tool_use blocks belong in assistant turns")
        if block.type == "text":
            texts.append(block.text)
            continue
        if texts:
            messages.append(ChatMessage(role="user", content="\n".join(texts)))
            texts = []
        messages.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=tool_result_text(block)))
    if texts or not messages:
        messages.append(ChatMessage(role="user", content="\n".join(texts)))
    return messages


def tool_result_text(block: AnthropicContentBlock) -> str:
    text = "\n".join(part.text for part in block.content or [])
    return f"Error: {text}" if block.is_error else text  # the model should know that the call failed


def misplaced(index: int, number: int, why: str) -> BadRequest:
    field = f"messages.{index}.content.{number}"
    return BadRequest(f"{field}: {why}", field=field)


# ------------------------------------------------------------------------------------------ the reply


@dataclass
class Outcome:
    """What the deltas of one reply add up to."""

    text: str = ""
    finish_reason: str = "stop"
    stop_sequence: Optional[str] = None
    tokens: int = 0

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.tokens += delta.token_count
        if delta.finish_reason:
            self.finish_reason, self.stop_sequence = delta.finish_reason, delta.stop_sequence


class MessageReply:
    """One reply in Anthropic's wire format: a message, or its events as the deltas come. With tools offered and a
    free choice, a reply is a tool call or text, known only at its end: its blocks are then sent whole."""

    def __init__(self, model: ServedModel, tools: Optional[list[Tool]], input_tokens: int, plan: tuple, stats):
        self.model, self.tools, self.input_tokens, self.stats = model, tools, input_tokens, stats
        self.choices, self.make_request = plan
        self.whole_blocks = tools is not None
        self.id = wire.new_id("msg")

    def message(self) -> dict:
        outcome = Outcome()
        for _, delta in self.choices.run(self.make_request, lambda: False, self.stats):
            outcome.add(delta)
        blocks, stop_reason, stop_sequence = self.finish(outcome)
        usage = wire.usage(self.input_tokens, outcome.tokens)
        return wire.message(self.id, self.model.name, blocks, stop_reason, stop_sequence, usage)

    def events(self, cancelled) -> Iterator[dict]:
        yield wire.message_start(self.id, self.model.name, self.input_tokens)
        if not self.whole_blocks:
            yield wire.block_start(0, wire.text_block(""))
        yield wire.ping()
        outcome = Outcome()
        for _, delta in self.choices.run(self.make_request, cancelled, self.stats):
            outcome.add(delta)
            if delta.text and not self.whole_blocks:
                yield wire.text_delta(0, delta.text)
        blocks, stop_reason, stop_sequence = self.finish(outcome)
        if self.whole_blocks:
            for index, block in enumerate(blocks):
                yield from wire.whole_block_events(index, block)
        else:
            yield wire.block_stop(0)
        yield wire.message_delta(stop_reason, stop_sequence, outcome.tokens)
        yield wire.message_stop()

    def finish(self, outcome: Outcome) -> tuple[list[dict], str, Optional[str]]:
        """The reply's content blocks (tool_use blocks when it parses as tool calls), stop reason and sequence."""
        calls = parse_tool_calls(outcome.text, self.tools) if self.tools else None
        if calls:
            return [wire.tool_use_block(name, arguments) for name, arguments in calls], "tool_use", None
        reason = wire.stop_reason(outcome.finish_reason, outcome.stop_sequence)
        return [wire.text_block(outcome.text)], reason, outcome.stop_sequence
