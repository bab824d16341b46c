"""One error tree for every API, turned into a reply in one place.

    APIError                      500  internal_error        (the message never carries a traceback)
    ├── BadRequest                400  invalid_request       a field is missing, mistyped or out of range
    │   └── LengthExceeded        400  context_length_exceeded
    ├── Unauthorized              401  invalid_api_key       keys are configured and none (or a wrong one) came
    ├── Forbidden                 403  origin_not_allowed    a WebSocket handshake from a page not on ALLOWED_ORIGINS
    │   └── KeylessSharingOff     403  keyless_sharing_off   state kept per caller, asked of a gateway without keys
    ├── NotFound                  404  not_found             unknown model, session or route
    ├── IdleTimeout               408  idle_timeout          a WebSocket said nothing for WS_IDLE_TIMEOUT (then closed)
    ├── SessionBusy               409  session_busy          another request is using this session
    ├── PayloadTooLarge           413  request_too_large     a body over MAX_BODY_BYTES
    ├── TooManySessions           429  too_many_sessions     the cap on open sessions, overall or per client
    ├── TooManyWebSockets         429  too_many_websockets   the cap on open WebSockets, overall or per client
    ├── RateLimited               429  rate_limited          the client's REQUESTS_PER_MINUTE are spent
    ├── Unavailable               503  swarm_unavailable     the swarm cannot serve this now
    └── HTTPError                 4xx  (werkzeug's name)     what Flask refuses by itself: a wrong method, ...

The 429s carry Retry-After. A 503 says what failed in the gateway's own words: the swarm's errors carry peer ids,
transport reprs and text that servers chose, which go to the log only (UNAVAILABLE). Each dialect wraps an error in
its own envelope (its format.py: error_body), and create_app's one error handler picks the envelope by the dialect a
request speaks (gateway/__init__.py).
"""

from __future__ import annotations

import logging

from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

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


class Forbidden(APIError):
    status, code = 403, "origin_not_allowed"


class KeylessSharingOff(Forbidden):
    code = "keyless_sharing_off"


class NotFound(APIError):
    status, code = 404, "not_found"


class IdleTimeout(APIError):
    status, code = 408, "idle_timeout"


class SessionBusy(APIError):
    status, code = 409, "session_busy"


class PayloadTooLarge(APIError):
    status, code = 413, "request_too_large"


class TooManySessions(APIError):
    status, code = 429, "too_many_sessions"
    retry_after = 1  # seconds: sessions come and go quickly


class TooManyWebSockets(APIError):
    status, code = 429, "too_many_websockets"
    retry_after = 1


class RateLimited(APIError):
    status, code = 429, "rate_limited"

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(APIError):
    status, code = 503, "swarm_unavailable"


class HTTPError(APIError):
    """A refusal of Flask's own (an unknown route, a wrong method), in the shape of the others."""

    def __init__(self, error: HTTPException):
        super().__init__(error.description or error.name)
        self.status, self.code = error.code or 500, error.name.lower().replace(" ", "_")
        # e.g. Allow on a 405; the body is ours, so not werkzeug's Content-Type
        self._headers = {name: value for name, value in error.get_headers() if name.lower() != "content-type"}

    def headers(self) -> dict:
        return {**self._headers, **super().headers()}


# what a 503 says for each of the swarm's errors, the first that fits (any other SwarmError: the last line)
UNAVAILABLE = (
    (MissingBlocksError, "no server holds some of this model's blocks now (the swarm's coverage: /api/v1/swarm); "
                         "retry later"),
    (CacheFullError, "every server that could serve this model's blocks has a full cache now; retry later"),
    (ServerUnavailableError, "the swarm's servers for this model failed or did not answer; retry later"),
    (SwarmError, "the swarm failed to serve this request; retry later"),
)


def unavailable(error: SwarmError) -> Unavailable:
    """The 503 for a swarm's error; what the error itself says is logged (without a traceback)."""
    logger.warning("the swarm could not serve a request: %s: %s", type(error).__name__, error)
    return Unavailable(next(message for kind, message in UNAVAILABLE if isinstance(error, kind)))


def from_exception(error: BaseException) -> APIError:
    """Any exception as the APIError a client should see; unexpected ones are logged, never shown."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, RequestEntityTooLarge):  # a chunked body that outgrew MAX_BODY_BYTES while being read
        return PayloadTooLarge("the request body is larger than this gateway accepts (MAX_BODY_BYTES)")
    if isinstance(error, HTTPException):
        return HTTPError(error)
    if isinstance(error, SessionLengthError):
        return LengthExceeded(str(error))
    if isinstance(error, UnknownModelError):
        return NotFound(str(error))
    if isinstance(error, BadRequestError):  # a server refused what the gateway sent: our bug, not the user's
        logger.error("a block server refused a request: %s", error)
        return APIError("internal error: a block server refused the request")
    if isinstance(error, SwarmError):
        return unavailable(error)
    logger.exception("unexpected error", exc_info=error)
    return APIError("internal error (see the gateway's log)")

