"""The request shapes of OpenAI's Responses API (POST /v1/responses), as pydantic models.

`input` is a text (one user message) or a list of items: messages (whose content is a text or input_text parts;
an earlier reply's output_text parts may come back as input), function_call items (the model's earlier calls),
function_call_output items (what those calls returned) and reasoning items (an earlier reply's reasoning: accepted,
and left out of the prompt, as thinking templates leave earlier reasoning out). Tools are function tools in the Responses API's flat
shape. Unknown fields are accepted and ignored, as on the rest of the OpenAI API; a bad field is a 400 naming it.

A response echoes its request's settings, and a stored one is kept: the fields echoed but not part of the prompt
(metadata, user, text.format's name and description, ids and names) are bounded here as OpenAI bounds them; what
goes into the prompt (input, instructions, tools) is bounded by the model's context.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag, field_validator
from pydantic_core import PydanticCustomError

from gateway.chat.schemas import ExtensibleRequest

# OpenAI's bounds on what a response echoes (metadata: "16 key-value pairs, keys up to 64 characters, values up to
# 512"); the others are generous bounds of ours on fields OpenAI leaves open
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
MAX_USER_CHARS = 512
MAX_ID_CHARS = 128
MAX_DESCRIPTION_CHARS = 8192  # a tool's, a text format's
MAX_INSTRUCTIONS_CHARS = 1 << 18  # in the prompt too, so the context bounds them in tokens; this, in characters


class ResponsesTextPart(ExtensibleRequest):
    type: Literal["input_text", "output_text"]
    text: str


def _text_or_parts(value) -> str:
    """"parts" for a list, else "text" (so that a wrong value is reported against one shape, not both)."""
    return "parts" if isinstance(value, list) else "text"


ResponsesContent = Annotated[
    Union[Annotated[str, Tag("text")], Annotated[list[ResponsesTextPart], Tag("parts")]],
    Discriminator(_text_or_parts),
]


class ResponsesMessageItem(ExtensibleRequest):
    type: Literal["message"] = "message"  # OpenAI's "easy input message" leaves it out
    role: Literal["user", "assistant", "system", "developer"]
    content: ResponsesContent


class ResponsesFunctionCallItem(ExtensibleRequest):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # a JSON object, as text


class ResponsesFunctionCallOutputItem(ExtensibleRequest):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: ResponsesContent


class ResponsesReasoningItem(ExtensibleRequest):
    type: Literal["reasoning"]
    id: Optional[str] = Field(None, max_length=MAX_ID_CHARS)


class ResponsesReasoningConfig(ExtensibleRequest):
    """`reasoning`: an effort of "none" turns a thinking model's thinking off where its template can (any other
    effort leaves the template's default); the summary setting is echoed (the reasoning comes whole, as content)."""

    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None


def _item_kind(item) -> str:
    """The item's type: "message" when a message leaves it out (or when the item is not even an object)."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", "message")


ResponsesInputItem = Annotated[
    Union[Annotated[ResponsesMessageItem, Tag("message")],
          Annotated[ResponsesFunctionCallItem, Tag("function_call")],
          Annotated[ResponsesFunctionCallOutputItem, Tag("function_call_output")],
          Annotated[ResponsesReasoningItem, Tag("reasoning")]],
    Discriminator(_item_kind),
]


def _input_kind(value) -> str:
    """"items" for a list, else "text"."""
    return "items" if isinstance(value, list) else "text"


ResponsesInput = Annotated[
    Union[Annotated[str, Field(min_length=1), Tag("text")],
          Annotated[list[ResponsesInputItem], Field(min_length=1), Tag("items")]],
    Discriminator(_input_kind),
]


class ResponsesFunctionTool(ExtensibleRequest):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Optional[str] = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class ResponsesNamedToolChoice(ExtensibleRequest):
    type: Literal["function"]
    name: str = Field(max_length=64)


class ResponsesTextFormat(ExtensibleRequest):
    """text.format: plain text, any JSON object, or JSON valid against `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(None, max_length=64)
    schema_: Optional[dict] = Field(None, alias="schema")  # bounded in depth where it is compiled (engine/grammar.py)
    strict: Optional[bool] = None
    description: Optional[str] = Field(None, max_length=MAX_DESCRIPTION_CHARS)


class ResponsesTextConfig(ExtensibleRequest):
    format: Optional[ResponsesTextFormat] = None


class ResponseCreateRequest(ExtensibleRequest):
    model: Optional[str] = None
    input: ResponsesInput  # a text (one user message), or a list of items
    # a system message before the input; not carried on to a follow-up
    instructions: Optional[str] = Field(None, max_length=MAX_INSTRUCTIONS_CHARS)
    previous_response_id: Optional[str] = Field(None, max_length=MAX_ID_CHARS)  # continue its conversation
    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)  # vLLM's extra fields, as on chat completions
    seed: Optional[int] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    text: Optional[ResponsesTextConfig] = None
    reasoning: Optional[ResponsesReasoningConfig] = None
    tools: Optional[list[ResponsesFunctionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], ResponsesNamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None  # None: true
    store: Optional[bool] = None  # None: true
    stream: Optional[bool] = None
    background: Optional[bool] = None  # run on after the reply, which comes at once; poll it, or cancel it
    metadata: Optional[dict[str, str]] = None  # OpenAI's bounds: see metadata_as_openai_bounds_it
    user: Optional[str] = Field(None, max_length=MAX_USER_CHARS)

    @field_validator("metadata")
    @classmethod
    def metadata_as_openai_bounds_it(cls, metadata: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_PAIRS:
            raise PydanticCustomError("metadata", "at most {most} key-value pairs, got {count}",
                                      {"most": MAX_METADATA_PAIRS, "count": len(metadata)})
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise PydanticCustomError("metadata", "keys of at most {most} characters, got one of {count}",
                                          {"most": MAX_METADATA_KEY_CHARS, "count": len(key)})
            if len(value) > MAX_METADATA_VALUE_CHARS:
                raise PydanticCustomError("metadata", "values of at most {most} characters, got one of {count}",
                                          {"most": MAX_METADATA_VALUE_CHARS, "count": len(value)})
        return metadata
