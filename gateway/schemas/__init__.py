"""Every request and event shape of the Petals Chat APIs (HTTP /api/v1 and WebSocket /api/v2), as pydantic models.

Values arrive as JSON, or as form and query strings (chat.petals.dev read `request.values`), so numbers and
booleans are parsed leniently ("0.7", "1", "true"); anything else wrong is a 400 naming the field.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from gateway.errors import BadRequest


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class GenerationFields(_Request):
    """The generation parameters shared by HTTP generate and WebSocket generate (None: the model's default)."""

    inputs: Optional[str] = None
    do_sample: Optional[bool] = None
    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_k: Optional[int] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=100)
    max_length: Optional[int] = Field(None, ge=1)
    max_new_tokens: Optional[int] = Field(None, ge=0)
    seed: Optional[int] = None
    stop_sequence: Optional[str] = None
    extra_stop_sequences: Optional[list[str]] = None

    def stop_sequences(self) -> list[str]:
        stops = [self.stop_sequence, *(self.extra_stop_sequences or [])]
        return [stop for stop in stops if stop]


class HttpGenerate(GenerationFields):
    model: Optional[str] = None
    session_id: Optional[str] = None


class OpenSession(_Request):
    model: Optional[str] = None
    max_length: int = Field(ge=1)


class CloseSession(_Request):
    session_id: str


class WsOpenSession(OpenSession):
    type: Literal["open_inference_session"]


class WsGenerate(GenerationFields):
    type: Literal["generate"]
    # chat mode: new turns, rendered with the model's chat template; the gateway keeps the transcript
    messages: Optional[list["ChatMessage"]] = None
    stream: bool = False  # frames of max_new_tokens tokens until a stop, as a stop_sequence does
    max_reply_tokens: Optional[int] = Field(None, ge=1)  # with stream: a bound on the whole reply
    regenerate: bool = False  # rewind to the start of the last reply and generate it again


class WsStop(_Request):
    """Ends the reply being generated; the session stays open."""

    type: Literal["stop"]


class WsCloseSession(_Request):
    type: Literal["close_inference_session"]


# ============================================================================================ OpenAI API
# The union of OpenAI's own fields and those of MLC-LLM, mistral.rs and Ai00. Unknown fields are accepted
# and ignored (logged once per field name), as vLLM does.


class _OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class StreamOptions(_OpenAIRequest):
    include_usage: bool = False


class SamplerOverride(_OpenAIRequest):
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


class JsonSchemaFormat(_OpenAIRequest):
    name: str = "response"
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None


class ResponseFormat(_OpenAIRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputs(_OpenAIRequest):
    """vLLM's structured_outputs: the reply is JSON valid against a schema, matches a regular expression, is one of
    the choices, or follows a grammar (GBNF or Lark). One of them per request."""

    json_: Optional[Union[dict, str]] = Field(None, alias="json")  # a JSON schema, or its text
    regex: Optional[str] = None
    choice: Optional[list[str]] = Field(None, min_length=1)
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


class SamplingFields(_OpenAIRequest):
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
    logit_bias: Optional[dict[int, float]] = None
    bias: Optional[dict[int, float]] = None  # Ai00's name for logit_bias
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


class ContentPart(_OpenAIRequest):
    type: str
    text: Optional[str] = None


class FunctionCall(_OpenAIRequest):
    name: str
    arguments: str = "{}"


class ToolCall(_OpenAIRequest):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_OpenAIRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None


class FunctionDefinition(_OpenAIRequest):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Optional[str] = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: Optional[bool] = None


class Tool(_OpenAIRequest):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(_OpenAIRequest):
    type: Literal["function"]
    function: dict


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    suffix: Optional[str] = None


class EmbeddingRequest(_OpenAIRequest):
    input: Union[str, list[str], list[int], list[list[int]]]
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    layer: Optional[int] = Field(None, ge=0)  # Ai00: use this layer's hidden states (0 = the embeddings)
    dimensions: Optional[int] = Field(None, ge=1)


class ChooseRequest(_OpenAIRequest):
    input: Union[str, list[str]]
    choices: list[str] = Field(min_length=1)
    model: Optional[str] = None


class TokenizeRequest(_OpenAIRequest):
    model: Optional[str] = None
    prompt: Optional[str] = None
    text: Optional[str] = None  # llama.cpp and MLC spell it content or text
    content: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True


class DetokenizeRequest(_OpenAIRequest):
    model: Optional[str] = None
    tokens: list[int]


# ============================================================================================ parsing

WsMessage = TypeAdapter(
    Annotated[Union[WsOpenSession, WsGenerate, WsStop, WsCloseSession], Field(discriminator="type")]
)


def load_json(raw, what: str = "the body"):
    """JSON text (str or bytes) as Python values. Whatever is not JSON is a 400: bad syntax or encoding, nesting
    too deep for the parser, NaN or Infinity (JavaScript's, not JSON's), and numbers too large for a float."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise BadRequest(f"{what} is not valid JSON: nested too deeply") from None
    except (TypeError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRequest(f"{what} is not valid JSON: {error}") from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large for a number")
    return value


def parse(schema, data):
    """Validate `data` into `schema` (a model class or WsMessage); a BadRequest names the first bad field."""
    if not isinstance(data, dict):
        raise BadRequest("the request must be a JSON object")
    try:
        return schema.validate_python(data) if schema is WsMessage else schema.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        if schema is WsMessage and first["type"] in ("union_tag_invalid", "union_tag_not_found"):
            raise BadRequest(f"type: must be one of {', '.join(WS_MESSAGE_TYPES)}", field="type") from None
        location = first["loc"][1:] if schema is WsMessage else first["loc"]  # a union's errors start with the tag
        field = ".".join(str(part) for part in location)
        raise BadRequest(f"{field}: {first['msg']}", field=field) from None


WS_MESSAGE_TYPES = ("open_inference_session", "generate", "stop", "close_inference_session")
