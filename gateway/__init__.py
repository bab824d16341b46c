"""Everything that knows about users: the Petals Chat HTTP and WebSocket APIs, served by Flask.

In data-flow order:

    schemas.py    every request and reply shape (pydantic); a bad field is a 400 that names it
    http_api.py   /api/v1/generate, open/close_inference_session, /api/v1/models, /health
    ws_api.py     /api/v2/generate: a session per WebSocket connection, streamed replies, a stop message
    engine.py     the one generation loop: inputs + GenerationRequest -> Deltas; served models and sessions
    sampling.py   SamplingParams and the pure choice of a token (penalties, greedy, temperature, top-k/p)
    text.py       stop sequences matched across token boundaries, never shown half
    sessions.py   open sessions: a cap, idle expiry that frees the servers' caches, one request at a time
    errors.py     the APIError tree, and how any exception becomes a clean reply

create_app() is cheap: the engine connects to the swarm on the first request that needs a model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"


def create_app(settings=None, engine=None):
    """The Flask app. `settings` defaults to config.Settings.from_env(); tests may pass their own engine."""
    from flask import Flask, jsonify
    from werkzeug.exceptions import HTTPException

    from config import Settings
    from gateway.engine import Engine
    from gateway.errors import APIError, error_body, from_exception
    from gateway.http_api import blueprint as http_blueprint
    from gateway.ws_api import blueprint as ws_blueprint
    from gateway.ws_api import sock

    settings = settings or Settings.from_env()
    app = Flask(__name__, static_folder=str(STATIC_DIR), static_url_path="/static")
    app.json.ensure_ascii = False
    limits = settings.gateway.limits
    app.config["SOCK_SERVER_OPTIONS"] = {
        "ping_interval": limits.ws_ping_interval,
        "max_message_size": limits.ws_max_message_bytes,
    }
    app.extensions["engine"] = engine or Engine(settings)
    app.register_blueprint(http_blueprint)
    app.register_blueprint(ws_blueprint)
    sock.init_app(app)

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException):
        return jsonify(ok=False, error=error.description, code=error.name.lower().replace(" ", "_"),
                       traceback=error.description), error.code

    @app.errorhandler(Exception)
    def api_error(error: Exception):
        api_error: APIError = from_exception(error)
        return jsonify(error_body(api_error)), api_error.status

    return app
