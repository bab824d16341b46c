"""Every request and event shape of the Petals Chat APIs (HTTP /api/v1 and WebSocket /api/v2), as pydantic models.

Values arrive as JSON, or as form and query strings (chat.petals.dev read `request.values`), so numbers and
booleans are parsed leniently ("0.7", "1", "true"); anything else wrong is a 400 naming the field.
"""

from __future__ import annotations

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


class WsStop(_Request):
    """Ends the reply being generated; the session stays open."""

    type: Literal["stop"]


class WsCloseSession(_Request):
    type: Literal["close_inference_session"]


WsMessage = TypeAdapter(
    Annotated[Union[WsOpenSession, WsGenerate, WsStop, WsCloseSession], Field(discriminator="type")]
)


def parse(schema, data):
    """Validate `data` into `schema` (a model class or WsMessage); a BadRequest names the first bad field."""
    if not isinstance(data, dict):
        raise BadRequest("the request must be a JSON object")
    try:
        return schema.validate_python(data) if schema is WsMessage else schema.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        if first["type"] in ("union_tag_invalid", "union_tag_not_found"):
            raise BadRequest(f"type: must be one of {', '.join(WS_MESSAGE_TYPES)}", field="type") from None
        location = first["loc"][1:] if schema is WsMessage else first["loc"]  # a union's errors start with the tag
        field = ".".join(str(part) for part in location)
        raise BadRequest(f"{field}: {first['msg']}", field=field) from None


WS_MESSAGE_TYPES = ("open_inference_session", "generate", "stop", "close_inference_session")


# -------------------------------------------------------------------------------------------- replies


class GenerateReply(BaseModel):
    ok: bool = True
    outputs: str
    token_count: int


class WsGenerateReply(GenerateReply):
    stop: bool


class SessionReply(BaseModel):
    ok: bool = True
    session_id: str
