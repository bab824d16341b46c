"""The request and message shapes of Petals Chat's APIs (HTTP /api/v1 and WebSocket /api/v2), as pydantic models.

Values arrive as JSON, or as form and query strings (chat.petals.dev read `request.values`), so numbers and
booleans are parsed leniently ("0.7", "1", "true"); anything else wrong is a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from gateway.chat.schemas import ChatMessage
from gateway.errors import BadRequest
from gateway.web.bodies import first_bad_field


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
    max_length: Optional[int] = Field(None, ge=1)  # required unless session_id resumes a session (it keeps its own)
    session_id: Optional[str] = None  # resume this stored session (the reply to an earlier open named it)

    @model_validator(mode="after")
    def _max_length_or_session(self):
        if self.max_length is None and self.session_id is None:
            raise BadRequest("max_length: required to open a new session", field="max_length")
        return self


class WsGenerate(GenerationFields):
    type: Literal["generate"]
    # chat mode: new turns, rendered with the model's chat template; the gateway keeps the transcript
    messages: Optional[list[ChatMessage]] = None
    stream: bool = False  # frames of max_new_tokens tokens until a stop, as a stop_sequence does
    max_reply_tokens: Optional[int] = Field(None, ge=1)  # with stream: a bound on the whole reply
    regenerate: bool = False  # rewind to the start of the last reply and generate it again


class WsStop(_Request):
    """Ends the reply being generated; the session stays open."""

    type: Literal["stop"]


class WsCloseSession(_Request):
    type: Literal["close_inference_session"]



WS_MESSAGE_TYPES = ("open_inference_session", "generate", "stop", "close_inference_session")
WsMessage = TypeAdapter(
    Annotated[Union[WsOpenSession, WsGenerate, WsStop, WsCloseSession], Field(discriminator="type")]
)


def parse_ws_message(data) -> Union[WsOpenSession, WsGenerate, WsStop, WsCloseSession]:
    """A WebSocket message (JSON values) as its shape; a BadRequest names the first bad field."""
    if not isinstance(data, dict):
        raise BadRequest("the request must be a JSON object")
    try:
        return WsMessage.validate_python(data)
    except ValidationError as error:
        if error.errors()[0]["type"] in ("union_tag_invalid", "union_tag_not_found"):
            raise BadRequest(f"type: must be one of {', '.join(WS_MESSAGE_TYPES)}", field="type") from None
        raise first_bad_field(error, skip=1) from None  # a union's errors start with the tag
