"""The request shapes of Ollama's API (/api/chat, /api/generate, /api/embed, /api/embeddings, /api/show), as pydantic
models.

Ollama's server decodes JSON into typed Go structs, so a value of the wrong type is refused, never coerced: these
models are strict ("0.7" is not a temperature, 1 is not true), and such a value is a 400 naming the field
("options.temperature"). Unknown fields, and unknown `options` (num_ctx, num_gpu, repeat_last_n, ...: Ollama's own
runtime), are ignored as Ollama ignores them. The bounds are the gateway's, the same as the OpenAI API's.
Fields that take one of two shapes (a string or a list, "json" or a schema) are read by a validator of their own,
so that a wrong value's error names the field rather than a branch of a union.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, WithJsonSchema

from gateway.chat.schemas import NamedToolChoice, Tool


def _one_or_many(value):
    """A single string stands for a list of one (an empty string for none, as Ollama reads `input`)."""
    if isinstance(value, str):
        return [value] if value else []
    return value


def _format(value):
    if value is None or value in ("", "json") or isinstance(value, dict):
        return value or None
    raise ValueError('must be "json" or a JSON schema (an object)')


Strings = Annotated[list[str], BeforeValidator(_one_or_many),
                    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]})]
Format = Annotated[Any, PlainValidator(_format),
                   WithJsonSchema({"anyOf": [{"enum": ["", "json"]}, {"type": "object"}, {"type": "null"}]})]


class _OllamaRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)


class OllamaOptions(_OllamaRequest):
    """The sampling options this gateway honours, in Ollama's names (a Modelfile's PARAMETERs)."""

    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_k: Optional[int] = Field(None, ge=-1)  # 0 or -1: off
    top_p: Optional[float] = Field(None, gt=0, le=1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    typical_p: Optional[float] = Field(None, gt=0, le=1)
    repeat_penalty: Optional[float] = Field(None, gt=0, le=100)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    mirostat: Optional[int] = Field(None, ge=0, le=2)
    mirostat_tau: Optional[float] = Field(None, gt=0)
    mirostat_eta: Optional[float] = Field(None, gt=0, le=1)
    seed: Optional[int] = None  # negative: a fresh random seed (Ollama's default is -1)
    num_predict: Optional[int] = Field(None, ge=-2)  # -1 (no cap) and -2 (fill the context): the context's rest
    stop: Optional[Strings] = None


class OllamaFunctionCall(_OllamaRequest):
    name: str
    arguments: dict = Field(default_factory=dict)  # an object, as Ollama sends it back (not OpenAI's JSON string)


class OllamaToolCall(_OllamaRequest):
    function: OllamaFunctionCall


class OllamaMessage(_OllamaRequest):
    role: Literal["system", "user", "assistant", "tool"]
    content: Optional[str] = None
    images: Optional[list[str]] = None  # refused unless empty: the swarm serves text models
    tool_calls: Optional[list[OllamaToolCall]] = None
    tool_name: Optional[str] = None  # on a tool's reply: the function that answered
    thinking: Optional[str] = None  # an earlier reply's reasoning: not shown to the model again, as Ollama does


class _OllamaGeneration(_OllamaRequest):
    """What /api/chat and /api/generate share. `stream` defaults to true: NDJSON, a JSON object per line."""

    model: Optional[str] = None  # None: the gateway's default model
    format: Format = None
    options: Optional[OllamaOptions] = None
    stream: Optional[bool] = None
    keep_alive: Optional[Union[float, str]] = None  # accepted; the swarm keeps its models loaded regardless
    # a thinking model's switch: true (or an effort: "low", "medium", "high") on, false off; refused (as Ollama
    # does) when asked of a model whose template does not think
    think: Optional[Union[bool, str]] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)


class OllamaChatRequest(_OllamaGeneration):
    messages: list[OllamaMessage] = Field(default_factory=list)  # none: just load the model (done_reason "load")
    tools: Optional[list[Tool]] = None
    # this gateway's extension, as in OpenAI's API: "required" or a named function forces one call by grammar
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None


class OllamaGenerateRequest(_OllamaGeneration):
    prompt: str = ""  # empty: just load the model (done_reason "load")
    system: Optional[str] = None
    raw: Optional[bool] = None  # the prompt as it is, without the chat template
    context: Optional[list[int]] = None  # the token ids an earlier reply returned, to continue from
    suffix: Optional[str] = None  # refused unless empty: no served model fills in the middle
    template: Optional[str] = None  # refused unless empty: Ollama's Go templates are not run here (use raw)
    images: Optional[list[str]] = None


class OllamaEmbedRequest(_OllamaRequest):
    model: Optional[str] = None
    input: Strings = Field(default_factory=list)
    truncate: Optional[bool] = None  # true (the default): inputs longer than the context are cut, not refused
    dimensions: Optional[int] = Field(None, ge=1)
    options: Optional[OllamaOptions] = None
    keep_alive: Optional[Union[float, str]] = None


class OllamaEmbeddingsRequest(_OllamaRequest):
    """The older /api/embeddings: one prompt, one vector, not normalized."""

    model: Optional[str] = None
    prompt: str = ""
    options: Optional[OllamaOptions] = None
    keep_alive: Optional[Union[float, str]] = None


class OllamaShowRequest(_OllamaRequest):
    model: Optional[str] = None
    name: Optional[str] = None  # older clients' name for `model`
    verbose: Optional[bool] = None
