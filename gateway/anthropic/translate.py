"""Anthropic's Messages API in chat's terms, translated once: tool_use blocks as an assistant's tool calls,
tool_result blocks as tool messages, Anthropic's tools and tool choice as chat's, and its sampling settings as
chat's SamplingFields (chat/params.py turns them into SamplingParams and a token budget).
"""

from __future__ import annotations

import json
from typing import Optional

from gateway.anthropic.schemas import AnthropicContentBlock, AnthropicCountTokensRequest, AnthropicMessage, AnthropicMessagesRequest
from gateway.chat.params import ToolChoice
from gateway.chat.plan import chat_prompt_ids
from gateway.chat.reasoning import template_kwargs
from gateway.chat.schemas import ChatMessage, FunctionCall, FunctionDefinition, NamedToolChoice, SamplingFields, Tool, ToolCall
from gateway.engine.served import ServedModel
from gateway.errors import BadRequest


def prompt_of(model: ServedModel, fields: AnthropicCountTokensRequest) -> tuple[list[int], ToolChoice]:
    """The prompt's token ids, and the tool choice in chat's terms. A conversation that ends with an assistant turn
    is a prefilled reply: the model goes on from its text."""
    tool_choice = tool_choice_of(fields)
    prefilled = fields.messages[-1].role == "assistant"
    return chat_prompt_ids(model, chat_messages(fields), tool_choice.tools, continue_final=prefilled,
                           template_kwargs=template_kwargs(thinking_of(fields))), tool_choice


def thinking_of(fields: AnthropicCountTokensRequest) -> Optional[bool]:
    """`thinking` as the template's switch: enabled on, disabled off, adaptive or absent the model's default."""
    kind = fields.thinking.type if fields.thinking is not None else "adaptive"
    return {"enabled": True, "disabled": False}.get(kind)


def tool_choice_of(fields: AnthropicCountTokensRequest) -> ToolChoice:
    """Anthropic's tool choice in OpenAI's terms: auto -> "auto", any -> "required", tool -> that function, none
    (or no tools) -> "none", when the tools are not even shown to the model. By default "auto" with tools."""
    choice = fields.tool_choice
    kind = choice.type if choice is not None else ("auto" if fields.tools else "none")
    if kind != "none" and not fields.tools:  # Anthropic refuses a tool_choice without tools, "auto" too
        raise BadRequest(f"tool_choice: {kind} needs tools", field="tool_choice")
    if kind == "none":
        return ToolChoice("none", None, False)
    tools = [Tool(type="function", function=FunctionDefinition(name=tool.name, description=tool.description,
                                                                parameters=tool.input_schema))
             for tool in fields.tools]
    named = NamedToolChoice(type="function", function={"name": choice.name}) if kind == "tool" else None
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    return ToolChoice({"auto": "auto", "any": "required"}.get(kind, named), tools, parallel)


def sampling_fields(fields: AnthropicMessagesRequest) -> SamplingFields:
    """The sampling settings in the shape chat/params.py reads, once, into SamplingParams and the token budget."""
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
    """An assistant turn is one message: its text, and its tool_use blocks as tool calls. Its thinking blocks are
    left out, as thinking templates leave an earlier reply's reasoning out of the prompt."""
    texts, calls = [], []
    for number, block in enumerate(turn.content):
        if block.type == "tool_result":
            raise misplaced(index, number, "tool_result blocks belong in user turns")
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "tool_use":
            calls.append(ToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=json.dumps(block.input))))
    return [ChatMessage(role="assistant", content="\n".join(texts), tool_calls=calls or None)]


def user_turn(turn: AnthropicMessage, index: int) -> list[ChatMessage]:
    """A user turn in order: each tool_result block a tool message (as OpenAI's tool messages are rendered), the
    text between them a user message."""
    messages, texts = [], []
    for number, block in enumerate(turn.content):
        if block.type in ("tool_use", "thinking", "redacted_thinking"):
            raise misplaced(index, number, f"{block.type} blocks belong in assistant turns")
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
