"""Who may call: API keys on every API (when any are configured) and CORS, as MLC's server flags set them.

A key comes as `Authorization: Bearer KEY` (the openai clients), `X-API-Key: KEY`, or `?api_key=KEY` (a
browser's WebSocket cannot set headers). /health, the chat page, its assets and the API docs stay open.
"""

from __future__ import annotations

import hmac

from flask import Flask, request

from config import AccessSettings
from gateway.errors import Unauthorized

OPEN_PATHS = ("/health", "/static/", "/docs", "/openapi.json")


def install(app: Flask, access: AccessSettings) -> None:
    from flask_cors import CORS

    CORS(app, origins=list(access.allowed_origins), methods=list(access.allowed_methods),
         allow_headers=list(access.allowed_headers), supports_credentials=access.allow_credentials)
    if not access.api_keys:
        return
    keys = [key.encode() for key in access.api_keys]

    @app.before_request
    def require_api_key():
        if request.method == "OPTIONS" or request.path == "/" or request.path.startswith(OPEN_PATHS):
            return None
        given = _presented_key()
        if given is None:
            raise Unauthorized("an API key is required: send it as 'Authorization: Bearer <key>'")
        if not any(hmac.compare_digest(given.encode(), key) for key in keys):
            raise Unauthorized("the API key is not valid")
        return None


def _presented_key():
    header = request.headers.get("Authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.headers.get("X-API-Key") or request.args.get("api_key")
