"""Petals Chat's wire format: the error envelope of its HTTP replies and WebSocket frames.

`{ok: false, error, code, traceback, field?}`: `traceback` repeats the clean message for old clients (chat.petals.dev
sent Python's traceback there; this gateway never does).
"""

from __future__ import annotations

from gateway.errors import APIError


def error_body(error: APIError) -> dict:
    body = {"ok": False, "error": error.message, "code": error.code, "traceback": error.message}
    if error.field:
        body["field"] = error.field
    return body
