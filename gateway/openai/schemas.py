"""The request shapes of the OpenAI-compatible API: OpenAI's own fields and those of MLC-LLM, mistral.rs and Ai00.

What chat-shaped requests share (sampling fields, messages, tools, structured output) is in gateway/chat/schemas.py;
unknown fields are accepted and ignored (logged once per name), as vLLM does.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field

from gateway.chat.schemas import ChatMessage, ExtensibleRequest, NamedToolChoice, SamplingFields, Tool


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True
    state: Optional[str] = Field(None, max_length=64)  # Ai00's: a saved state's messages come first
    # a thinking model's switch (chat/reasoning.py): vLLM's template variables, the top-level spelling, OpenAI's effort
    chat_template_kwargs: Optional[dict] = None
    enable_thinking: Optional[bool] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    suffix: Optional[str] = None
    state: Optional[str] = Field(None, max_length=64)  # Ai00's: a saved state's tokens come first


class SaveStateRequest(ExtensibleRequest):
    """POST /v1/states: a prefix computed once and kept by name (gateway/engine/saved_states.py)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    model: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)  # rendered as a chat's beginning
    prompt: Optional[Union[str, list[int]]] = Field(None, min_length=1)  # or plain text, or token ids
    cache_salt: Optional[str] = Field(None, max_length=256)


class EmbeddingRequest(ExtensibleRequest):
    input: Union[str, list[str], list[int], list[list[int]]]
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    layer: Optional[int] = Field(None, ge=0)  # Ai00: use this layer's hidden states (0 = the embeddings)
    dimensions: Optional[int] = Field(None, ge=1)


class EmbedsRequest(ExtensibleRequest):
    """Ai00's /embeds: each text cut into chunks of at most max_tokens tokens, `prefix` put before each chunk, one
    vector per chunk, from an embedding model (EMBEDDING_MODELS; by default the first)."""

    input: Union[str, list[str]]
    model: Optional[str] = None
    max_tokens: int = Field(510, ge=1)  # Ai00's default and cap (a 512-token encoder's room beside [CLS], [SEP])
    prefix: str = "query:"


class ChooseRequest(ExtensibleRequest):
    input: Union[str, list[str]]
    choices: list[str] = Field(min_length=1)
    model: Optional[str] = None


class TokenizeRequest(ExtensibleRequest):
    model: Optional[str] = None
    prompt: Optional[str] = None
    text: Optional[str] = None  # llama.cpp and MLC spell it content or text
    content: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True


class DetokenizeRequest(ExtensibleRequest):
    model: Optional[str] = None
    tokens: list[int]


