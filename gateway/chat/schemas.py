"""The request fields every chat-shaped API shares, as pydantic models: sampling, stops, structured output, chat
messages and tools. OpenAI's chat and text completions declare them directly; the Responses, Anthropic and Ollama
APIs translate their own shapes into them once.

The fields are the union of OpenAI's own and those of MLC-LLM, mistral.rs and Ai00. Unknown fields are accepted and
ignored (web/bodies.py logs each name once), as vLLM does. A chat message keeps only what the chat template renders
(MessageShape): messages outlive their request (MLC's stateful conversations, a WebSocket's stored transcript), and
a field nothing reads would grow them by whatever a client sends with each turn.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_LOGIT_BIAS = 300  # tokens one request may bias, as OpenAI allows


class ExtensibleRequest(BaseModel):
    """A request shape that accepts, and ignores, fields it does not know."""

    model_config = ConfigDict(extra="allow", frozen=True)


class MessageShape(BaseModel):
    """A part of a chat message: fields it does not know are accepted and dropped (see the module's docstring)."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class StreamOptions(ExtensibleRequest):
    include_usage: bool = False


class SamplerOverride(ExtensibleRequest):
    """Ai00's per-request sampler: Nucleus (default), Mirostat or Typical."""

    type: Literal["Nucleus", "Mirostat", "Typical"] = "Nucleus"
    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_k: Optional[int] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    penalty: Optional[float] = Field(None, ge=1)  # a half-life in tokens for the accumulated penalties
    penalty_decay: Optional[float] = Field(None, gt=0, le=1)
    tau: Optional[float] = Field(None, gt=0)  # Mirostat's target surprise, or Typical's mass
    rate: Optional[float] = Field(None, gt=0, le=1)  # Mirostat's learning rate


class JsonSchemaFormat(ExtensibleRequest):
    name: str = "response"
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None


class ResponseFormat(ExtensibleRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputs(ExtensibleRequest):
    """vLLM's structured_outputs: the reply is JSON valid against a schema, matches a regular expression, is one of
    the choices, or follows a grammar (GBNF or Lark). One of them per request."""

    json_: Optional[Union[dict, str]] = Field(None, alias="json")  # a JSON schema, or its text
    regex: Optional[str] = None
    choice: Optional[list[str]] = Field(None, min_length=1)
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


class SamplingFields(ExtensibleRequest):
    """What chat and text completions share."""

    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)  # -1 or 0: off
    min_p: Optional[float] = Field(None, ge=0, le=1)
    typical_p: Optional[float] = Field(None, gt=0, le=1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=100)
    penalty_decay: Optional[float] = Field(None, gt=0, le=1)
    # OpenAI's bound on the entries (both names' together: chat/params.py): each request's bias is a tensor of the
    # vocabulary's size on the LM head's device, built once (engine/sampler.py)
    logit_bias: Optional[dict[int, float]] = Field(None, max_length=MAX_LOGIT_BIAS)
    bias: Optional[dict[int, float]] = Field(None, max_length=MAX_LOGIT_BIAS)  # Ai00's name for logit_bias
    mirostat: Optional[int] = Field(None, ge=0, le=2)
    mirostat_tau: Optional[float] = Field(None, gt=0)
    mirostat_eta: Optional[float] = Field(None, gt=0, le=1)
    sampler_override: Optional[SamplerOverride] = None
    sampler: Optional[SamplerOverride] = None  # Ai00 accepts both names
    seed: Optional[int] = None
    n: int = Field(1, ge=1, le=16)
    stop: Optional[Union[str, list[Union[str, int]]]] = None  # strings, or token ids as mistral.rs allows
    stop_token_ids: Optional[list[int]] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    max_gen_len: Optional[int] = Field(None, ge=1)  # MLC-Chat
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    response_format: Optional[ResponseFormat] = None
    grammar: Optional[str] = None  # llama.cpp's GBNF
    bnf_schema: Optional[str] = None  # Ai00's BNF grammar
    structured_outputs: Optional[StructuredOutputs] = None  # vLLM's; and its older spellings of the same:
    guided_json: Optional[Union[dict, str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = Field(None, min_length=1)
    guided_grammar: Optional[str] = None
    user: Optional[str] = None
    # vLLM's: requests reuse cached conversations only with the same salt (and the same client: engine/warm.py)
    cache_salt: Optional[str] = Field(None, max_length=256)


class ContentPart(MessageShape):
    type: str
    text: Optional[str] = None


class FunctionCall(MessageShape):
    name: str
    arguments: str = "{}"


class ToolCall(MessageShape):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(MessageShape):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None


class FunctionDefinition(ExtensibleRequest):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Optional[str] = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: Optional[bool] = None


class Tool(ExtensibleRequest):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(ExtensibleRequest):
    type: Literal["function"]
    function: dict


