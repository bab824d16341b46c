"""Who may call, and who a caller is.

- API keys, when any are configured, guard every API: the Petals HTTP API, the WebSocket, the OpenAI API and
  /metrics. A key comes as `Authorization: Bearer KEY` (the openai clients), `X-API-Key: KEY` (the anthropic
  clients), or `?api_key=KEY` (what a browser's WebSocket can send: it cannot set headers). The pages, their
  assets, /health, Ollama's /api/version and the API docs stay open.
- CORS follows the allowlists (MLC's server flags). Browsers apply no CORS to WebSockets, so a WebSocket
  handshake from a page must come from an allowed origin, or from the gateway's own pages; clients that send no
  Origin (not browsers) are let through, and the keys guard them.
- A caller is its API key when keys are configured (a fingerprint, never the key itself), else its address;
  the per-client limits (web/limits.py, engine/sessions.py) count by that. Behind reverse proxies, TRUSTED_PROXIES says
  how many X-Forwarded-For hops to believe for the address. /stats and /verbose_stats show a caller its own requests.
- An address is everyone behind one NAT or proxy: without keys, what the gateway would keep for a caller between
  requests (MLC's stateful conversations, saved states) is refused (`caller_state_guard`) unless KEYLESS_SHARING
  says those callers are one trusted user; the warm prefixes follow the same setting (engine/warm.py).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Callable

from flask import Flask, current_app, g, request

from config import AccessSettings
from gateway.engine.stats import CALLER
from gateway.errors import Forbidden, KeylessSharingOff, Unauthorized

# /api/version: Ollama's clients ask it first to find the server (with no key), and it tells nothing else
OPEN_PREFIXES = ("/health", "/static/", "/docs", "/api-docs", "/openapi.json", "/api/version")
OPEN_PAGES = ("/", "/swarm")


def is_open(path: str) -> bool:
    """Paths that need no key and count against no limit: pages, assets, docs and the health check."""
    return path in OPEN_PAGES or path.startswith(OPEN_PREFIXES)


def install(app: Flask, access: AccessSettings) -> None:
    from flask_cors import CORS

    app.extensions["access"] = access

    if access.trusted_proxies:
        from werkzeug.middleware.proxy_fix import ProxyFix

        hops = access.trusted_proxies
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=hops, x_proto=hops, x_host=hops)
    CORS(app, origins=list(access.allowed_origins), methods=list(access.allowed_methods),
         allow_headers=list(access.allowed_headers), supports_credentials=access.allow_credentials)
    keys = [key.encode() for key in access.api_keys]
    origins = set(access.allowed_origins)

    @app.before_request
    def check_caller():
        if request.method != "OPTIONS" and not is_open(request.path):
            if _is_websocket_handshake():
                check_origin(origins)
            if keys:
                g.client = "key:" + _fingerprint(check_key(keys))
        CALLER.set(client_id())  # whose figures this request's stats are (engine/stats.py)


def check_key(keys: list[bytes]) -> str:
    given = _presented_key()
    if not given:
        raise Unauthorized("an API key is required: send it as 'Authorization: Bearer <key>' or 'X-API-Key: <key>'")
    # compare_digest against every key: how long a refusal takes tells nothing about how close a guess was
    if not any(hmac.compare_digest(given.encode(), key) for key in keys):
        raise Unauthorized("the API key is not valid")
    return given


def check_origin(allowed: set[str]) -> None:
    origin = request.headers.get("Origin")
    own = request.host_url.rstrip("/")  # the gateway's own chat page
    if origin and "*" not in allowed and origin not in allowed and origin != own:
        raise Forbidden(f"origin {origin!r} may not open a WebSocket here (ALLOWED_ORIGINS)")


def client_id() -> str:
    """Who is calling, for the per-client limits: 'key:<fingerprint>' when keys are configured, else 'ip:<address>'.
    Without configured keys a key proves nothing, so it cannot buy a client a fresh allowance."""
    return g.get("client") or f"ip:{request.remote_addr}"


def caller_state_guard(what: str) -> Callable[[], None]:
    """A blueprint's before_request hook for routes that keep `what` for a caller between requests."""
    return lambda: check_caller_state(what)


def check_caller_state(what: str, field: str | None = None) -> None:
    """Refuse `what` where a caller is only its address (no API keys) and KEYLESS_SHARING does not say that everyone
    behind an address is one user: one would continue another's conversation or use their saved states."""
    if not current_app.extensions["access"].keeps_caller_state:
        raise KeylessSharingOff(f"{what} are off: this gateway has no API keys, so everyone behind one address would "
                                "share them; configure API_KEYS, or set KEYLESS_SHARING=1 if everyone who can reach "
                                "the gateway is one trusted user", field=field)


def _presented_key() -> str | None:
    header = request.headers.get("Authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.headers.get("X-API-Key") or request.args.get("api_key")


def _is_websocket_handshake() -> bool:
    return request.headers.get("Upgrade", "").lower() == "websocket"


def _fingerprint(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]
