"""One error tree for every API, turned into a reply in one place.

    APIError                      500  internal_error        (the message never carries a traceback)
    ├── BadRequest                400  invalid_request       a field is missing, mistyped or out of range
    │   └── LengthExceeded        400  context_length_exceeded
    ├── NotFound                  404  not_found             unknown model, session or route
    ├── SessionBusy               409  session_busy          another request is using this session
    └── Unavailable               503  swarm_unavailable     the swarm cannot serve this now
        └── TooManySessions       503  too_many_sessions     the gateway's cap on open sessions is reached

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

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message, self.field = message, field


class BadRequest(APIError):
    status, code = 400, "invalid_request"


class LengthExceeded(BadRequest):
    code = "context_length_exceeded"


class NotFound(APIError):
    status, code = 404, "not_found"


class SessionBusy(APIError):
    status, code = 409, "session_busy"


class Unavailable(APIError):
    status, code = 503, "swarm_unavailable"


class TooManySessions(Unavailable):
    code = "too_many_sessions"


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
