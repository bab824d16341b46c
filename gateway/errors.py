"""One error tree for every API, turned into a reply in one place.

    APIError                      500  internal_error        (the message never carries a traceback)
    ├── BadRequest                400  invalid_request       a field is missing, mistyped or out of range
    │   └── LengthExceeded        400  context_length_exceeded
    ├── Unauthorized              401  invalid_api_key       keys are configured and none (or a wrong one) came
    ├── NotFound                  404  not_found             unknown model, session or route
    ├── SessionBusy               409  session_busy          another request is using this session
    ├── TooManySessions           429  too_many_sessions     the gateway's cap on open sessions is reached
    │                                                        (with Retry-After)
    └── Unavailable               503  swarm_unavailable     the swarm cannot serve this now

Petals Chat replies are `{ok: false, error, traceback}`; `traceback` repeats the clean message for old clients.
"""

from __future__ import annotations

import logging

from swarm.protocol import (
    BadRequestError,
    CacheFullError,
    MissingBlocksError,
    ServerUnavailableError,
    SessionLengthError,
    SwarmError,
    UnknownModelError,
)

logger = logging.getLogger(__name__)


class APIError(Exception):
    status = 500
    code = "internal_error"

    retry_after: int | None = None

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message, self.field = message, field

    def headers(self) -> dict:
        return {"Retry-After": str(self.retry_after)} if self.retry_after else {}


class BadRequest(APIError):
    status, code = 400, "invalid_request"


class LengthExceeded(BadRequest):
    code = "context_length_exceeded"


class Unauthorized(APIError):
    status, code = 401, "invalid_api_key"


class NotFound(APIError):
    status, code = 404, "not_found"


class SessionBusy(APIError):
    status, code = 409, "session_busy"


class Unavailable(APIError):
    status, code = 503, "swarm_unavailable"


class TooManySessions(APIError):
    status, code = 429, "too_many_sessions"
    retry_after = 1  # seconds: sessions come and go quickly


def from_exception(error: BaseException) -> APIError:
    """Any exception as the APIError a client should see; unexpected ones are logged, never shown."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, SessionLengthError):
        return LengthExceeded(str(error))
    if isinstance(error, UnknownModelError):
        return NotFound(str(error))
    if isinstance(error, (MissingBlocksError, CacheFullError, ServerUnavailableError)):
        return Unavailable(str(error))
    if isinstance(error, BadRequestError):  # a server refused what the gateway sent: our bug, not the user's
        logger.error("a block server refused a request: %s", error)
        return APIError("internal error: a block server refused the request")
    if isinstance(error, SwarmError):
        return Unavailable(f"the swarm failed: {error}")
    logger.exception("unexpected error", exc_info=error)
    return APIError("internal error (see the gateway's log)")


def error_body(error: APIError) -> dict:
    body = {"ok": False, "error": error.message, "code": error.code, "traceback": error.message}
    if error.field:
        body["field"] = error.field
    return body
