"""Everything that knows about users: the dialects clients speak, over one engine that generates on the swarm.

The tree is the diagram; dependencies point down it, never up (tests/unit/test_layout.py checks):

    petals/ openai/ (responses/) anthropic/ ollama/
                 one package per dialect, the same few modules in each: routes (Flask routes, `register` and
                 `speaks`), translate (the request in chat's or the engine's terms), format (the wire shapes, the
                 reply written in them, the error envelope), schemas (pydantic request shapes). No dialect
                 imports another.
    chat/        what the chat-shaped dialects share: the fields (schemas), params -> SamplingParams and the tool
                 choice, prompts (chat template), structured output, the plan (checked, session open), tool calls
                 read as they come (tool_stream.py) and the one reply assembly (reply.py: text and tool calls)
    web/         Flask-side plumbing: request ids, access (keys, CORS, origins), limits (body, rate, WebSockets),
                 metrics, health, request bodies, held sessions, SSE and NDJSON framing, the app's engine
    engine/      the one generation loop over served models and sessions: sampling, grammar, stops, lengths,
                 stats, token metrics (never imports Flask)
    errors.py    the one APIError tree
    docs.py      /openapi.json from every dialect's schemas, and the Swagger UI page

A request passes the hooks (request_ids, access, limits), is read into its dialect's schema, translated once, planned
and run on the engine, and leaves in its dialect's wire format. Every error, from any route or hook, leaves through
create_app's one error handler, in the envelope of the first dialect (DIALECTS' order) that `speaks` for the request.

Pages, from static/: / (index.html, the chat) and /swarm (swarm.html + swarm.js: servers and block coverage
per served model, like health.petals.dev, refreshed from /api/v1/swarm).

create_app() is cheap: the engine connects to the swarm on the first request that needs a model.
"""

from __future__ import annotations

from pathlib import Path


def _static_dir() -> Path:
    """The pages' folder: static/ beside this package in a checkout; once installed, the package's own static/,
    where pyproject.toml puts those files (the installed product needs no file of the checkout)."""
    package = Path(__file__).resolve().parent
    installed = package / "static"
    return installed if installed.is_dir() else package.parent / "static"


STATIC_DIR = _static_dir()


def dialects() -> tuple:
    """Each dialect's routes module (register, speaks, error_body), in the order an error's envelope is chosen:
    Anthropic's before OpenAI's, which claims every /v1 path; Petals' last, since it speaks for every request."""
    from gateway.anthropic import routes as anthropic
    from gateway.ollama import routes as ollama
    from gateway.openai import routes as openai
    from gateway.petals import routes as petals

    return anthropic, openai, ollama, petals


def create_app(settings=None, engine=None):
    """The Flask app. `settings` defaults to config.Settings.from_env(); tests may pass their own engine."""
    from config import Settings
    from gateway import docs
    from gateway.engine.generation import Engine
    from gateway.web import access, current_engine, health, held_sessions, limits, metrics, request_ids

    settings = settings or Settings.from_env()
    app = _flask_app(settings)
    current_engine.install(app, engine or Engine(settings))
    held_sessions.install(app)  # every request closes the sessions it opened for itself, whatever happens to it
    request_ids.install(app)
    access.install(app, settings.gateway.access)
    limits.install(app, settings.gateway.limits)
    for dialect in dialects():
        dialect.register(app)
    app.register_blueprint(health.blueprint)
    app.register_blueprint(docs.blueprint)
    metrics.install(app)
    _register_pages(app)
    _register_error_handler(app)
    return app


def _flask_app(settings):
    from flask import Flask

    from gateway.web.reader_threads import PooledThread

    app = Flask(__name__, static_folder=str(STATIC_DIR), static_url_path="/static")
    app.json.ensure_ascii = False
    app.config["SOCK_SERVER_OPTIONS"] = {
        "ping_interval": settings.gateway.limits.ws_ping_interval,
        "max_message_size": settings.gateway.limits.ws_max_message_bytes,
        "thread_class": PooledThread,  # connections coming and going start and end no threads
    }
    return app


def _register_pages(app) -> None:
    from flask import send_from_directory

    @app.get("/")
    def chat_page():
        return send_from_directory(STATIC_DIR, "index.html")

    @app.get("/swarm")
    def swarm_page():  # block coverage per server, drawn from /api/v1/swarm
        return send_from_directory(STATIC_DIR, "swarm.html")


def _register_error_handler(app) -> None:
    from flask import jsonify

    from gateway.errors import APIError, from_exception

    speakers = dialects()

    @app.errorhandler(Exception)
    def api_error(error: Exception):
        """Every error of every route and hook, Flask's own 404s and 405s included: a clean message in the
        envelope of the request's dialect, never a traceback (from_exception logs the unexpected ones)."""
        api_error: APIError = from_exception(error)
        dialect = next(dialect for dialect in speakers if dialect.speaks())
        return jsonify(dialect.error_body(api_error)), api_error.status, api_error.headers()
