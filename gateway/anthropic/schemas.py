"""The request shapes of Anthropic's Messages API (/v1/messages and /v1/messages/count_tokens), as pydantic models.

Text, tool_use and tool_result content blocks are served, and an earlier reply's thinking blocks (read, and left out
of the prompt, as thinking templates leave earlier reasoning out); images, documents and server tools are refused
with a 400 that names them (the swarm serves text models). `thinking` turns a thinking model's reasoning on or off.
Unknown fields are accepted and ignored (web/bodies.py logs each name once), so that clients newer than this gateway
(service_tier, cache_control, ...) still get a reply.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

# what each kind of content block must carry (a block is one model, so that a wrong `type` gets a clear message)
BLOCK_FIELDS = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",),
                "thinking": ("thinking",), "redacted_thinking": ("data",)}


class _AnthropicRequest(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class AnthropicTextBlock(_AnthropicRequest):
    """A text block where only text may stand: the system prompt, a tool result's content."""

    type: Literal["text"]
    text: str


def _text_as_blocks(value):
    """Content given as a string is one text block: read so, a bad block's error names the block, not a union."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


def _blocks(block):
    return Annotated[list[block], BeforeValidator(_text_as_blocks, json_schema_input_type=Union[str, list[block]])]


TextBlocks = _blocks(AnthropicTextBlock)


class AnthropicContentBlock(_AnthropicRequest):
    """One block of a turn: text, a tool call or an earlier reply's thinking (in an assistant turn), or a tool's
    result (in a user turn)."""

    type: Literal["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]
    text: Optional[str] = None
    id: Optional[str] = None  # tool_use
    name: Optional[str] = None
    input: Optional[dict] = None
    tool_use_id: Optional[str] = None  # tool_result
    content: Optional[TextBlocks] = None
    is_error: bool = False
    thinking: Optional[str] = None  # thinking
    signature: Optional[str] = None
    data: Optional[str] = None  # redacted_thinking

    @model_validator(mode="after")
    def has_its_fields(self):
        missing = [name for name in BLOCK_FIELDS[self.type] if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.type} block needs {', '.join(missing)}")
        return self


class AnthropicMessage(_AnthropicRequest):
    role: Literal["user", "assistant"]
    content: _blocks(AnthropicContentBlock)


class AnthropicTool(_AnthropicRequest):
    """A client tool; server tools (web search, code execution: a `type` other than custom) are not served."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Optional[str] = None
    input_schema: dict
    type: Optional[Literal["custom"]] = None


class AnthropicToolChoice(_AnthropicRequest):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None  # for type "tool": the tool to call
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def names_its_tool(self):
        if self.type == "tool" and not self.name:
            raise ValueError("a tool choice of type tool needs the tool's name")
        return self


class AnthropicThinking(_AnthropicRequest):
    """Extended thinking: on (with a budget, as Anthropic requires one) or off; "adaptive" leaves the model's
    default. A thinking model's template switch follows it (chat/reasoning.py); the budget is not enforced."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = Field(None, ge=1)

    @model_validator(mode="after")
    def has_a_budget(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking of type enabled needs budget_tokens")
        return self


class AnthropicMetadata(_AnthropicRequest):
    user_id: Optional[str] = None


class AnthropicCountTokensRequest(_AnthropicRequest):
    """What makes a prompt: the body of /v1/messages/count_tokens, and the first half of a messages request."""

    model: Optional[str] = None  # Anthropic's clients always send one; the gateway's default model otherwise
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Optional[TextBlocks] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[AnthropicThinking] = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    metadata: Optional[AnthropicMetadata] = None  # accepted; the gateway identifies callers by key or address
