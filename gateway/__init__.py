"""Everything that knows about users: the Petals Chat HTTP and WebSocket APIs, served by Flask.

In data-flow order: a request passes the hooks, is read into a schema and translated once into the engine's
terms by its API, runs in the engine, and leaves in its API's wire format.

    request_ids.py     a request id per request: taken from or put in X-Request-ID, and on every log line
    access.py          API keys, CORS and the WebSocket Origin check; who a caller is (its key, else its address)
    limits.py          body size, requests per minute per client, token and context-length checks the APIs share
    schemas/           every request and reply shape (pydantic), a module per API; a bad field is a 400 naming it
    http_api.py        /api/v1/generate, open/close_inference_session, /api/v1/models, /health, /api/v1/swarm
    ws_api.py          /api/v2/generate: a session per WebSocket connection, streamed replies, a stop message
    petals_params.py   Petals-style generation fields (HTTP and WebSocket) -> GenerationRequest, defaults filled in
    openai_api.py      the OpenAI-compatible API under /v1, /api/oai and /api/oai/v1; /tokenize, /stats, ...
    openai_params.py   OpenAI-style fields -> SamplingParams, token budget, stops, grammar
    structured_outputs.py  which structured output a request asks for: response_format, grammar, vLLM's
                       structured_outputs and guided_* (JSON schema, regex, choice, grammar), one at most
    json_bodies.py     a JSON body read into its schema for the OpenAI-style APIs, unknown fields ignored
    prompts.py         chat messages -> prompt (the model's chat template, tools); tool calls out of a reply
    openai_choices.py  n choices per prompt: lengths checked, a GenerationRequest per choice, one session rewound
    held_sessions.py   the sessions a request opened for itself, closed however it ends (error, stream cut, ...)
    current_engine.py  the app's one Engine: installed by create_app, read by every route with get_engine()
    engine.py          the one generation loop: inputs + GenerationRequest -> Deltas; served models and sessions
    sessions.py        open sessions: a cap, idle expiry that frees the servers' caches, one request at a time
    sampling.py        SamplingParams and the per-sequence Sampler (penalties, bias, Mirostat, top-k/p, min-p, ...)
    grammar.py         structured output: a token mask per step from a JSON schema or grammar (llguidance)
    text.py            stop sequences matched across token boundaries, never shown half
    stats.py           prefill and decode speeds of recent requests
    openai_format.py   OpenAI's wire format: completions, chunks, logprobs, usage, the error envelope
    responses_api.py   OpenAI's Responses API under the OpenAI prefixes: /responses (create, stream, background),
                       get, delete and cancel a stored one; a request is translated into a chat completion's
    responses_format.py  the Responses API's wire format: the response object, output items, numbered stream events
    responses_store.py   stored responses (store: true): a cap, idle expiry; what previous_response_id continues
    anthropic_api.py   Anthropic's Messages API: /v1/messages (tools, streamed events), /v1/messages/count_tokens
    anthropic_format.py  Anthropic's wire format: messages, content blocks, stream events, the error envelope
    ollama_api.py      Ollama's API under /api: chat, generate (NDJSON streams), embed, tags, show, ps, version
    ollama_params.py   Ollama's options, format and messages -> the OpenAI API's SamplingFields and ChatMessages
    ollama_format.py   Ollama's wire format: reply lines, durations in nanoseconds, models, the error shape
    ndjson.py          newline-delimited JSON streams: an error as the last line, cancel when the client leaves
    sse.py             server-sent events: keep-alives, errors as a last event, cancel when the client leaves
    errors.py          the APIError tree, and how any exception becomes a clean reply
    metrics.py         Prometheus metrics (requests, sessions, time to first token, inter-token latency) at /metrics
    docs.py            /openapi.json from the schemas, and a Swagger UI page at /docs (no CDN)

No API module imports another: what two of them share lives in a module of its own (current_engine, limits,
petals_params, errors).

Pages, from static/: / (index.html, the chat) and /swarm (swarm.html + swarm.js: servers and block coverage
per served model, like health.petals.dev, refreshed from /api/v1/swarm).

create_app() is cheap: the engine connects to the swarm on the first request that needs a model.
Every request passes, in order: request_ids (an id), access (key, WebSocket origin), limits (body size, rate);
every error, from any route or hook, leaves through the one error handler below, in the shape of its API.
"""

from __future__ import annotations

from pathlib import Path

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"


def create_app(settings=None, engine=None):
    """The Flask app. `settings` defaults to config.Settings.from_env(); tests may pass their own engine."""
    from config import Settings
    from gateway import access, current_engine, held_sessions, limits, metrics, request_ids
    from gateway.engine import Engine

    settings = settings or Settings.from_env()
    app = _flask_app(settings)
    current_engine.install(app, engine or Engine(settings))
    held_sessions.install(app)  # every request closes the sessions it opened for itself, whatever happens to it
    request_ids.install(app)
    access.install(app, settings.gateway.access)
    limits.install(app, settings.gateway.limits)
    _register_apis(app)
    metrics.install(app)
    _register_pages(app)
    _register_error_handler(app)
    return app


def _flask_app(settings):
    from flask import Flask

    app = Flask(__name__, static_folder=str(STATIC_DIR), static_url_path="/static")
    app.json.ensure_ascii = False
    app.config["SOCK_SERVER_OPTIONS"] = {
        "ping_interval": settings.gateway.limits.ws_ping_interval,
        "max_message_size": settings.gateway.limits.ws_max_message_bytes,
    }
    return app


def _register_apis(app) -> None:
    """Every API's blueprint: Petals' HTTP and WebSocket APIs, the OpenAI API under each of its prefixes, the docs."""
    from gateway import docs
    from gateway.http_api import blueprint as http_blueprint
    from gateway.http_api import monitoring as monitoring_blueprint
    from gateway.openai_api import PREFIXES as OPENAI_PREFIXES
    from gateway.openai_api import blueprint as openai_blueprint
    from gateway.openai_api import extras as openai_extras
    from gateway.ws_api import blueprint as ws_blueprint
    from gateway.ws_api import sock

    app.register_blueprint(http_blueprint)
    app.register_blueprint(monitoring_blueprint)
    app.register_blueprint(ws_blueprint)
    for prefix in OPENAI_PREFIXES:
        app.register_blueprint(openai_blueprint, url_prefix=prefix, name="openai" + prefix.replace("/", "_"))
    app.register_blueprint(openai_extras)
    from gateway.responses_api import blueprint as responses_blueprint

    for prefix in OPENAI_PREFIXES:  # OpenAI's Responses API, where its chat completions are
        app.register_blueprint(responses_blueprint, url_prefix=prefix,
                               name="openai_responses" + prefix.replace("/", "_"))
    from gateway.anthropic_api import PREFIX as ANTHROPIC_PREFIX
    from gateway.anthropic_api import blueprint as anthropic_blueprint

    app.register_blueprint(anthropic_blueprint, url_prefix=ANTHROPIC_PREFIX)
    from gateway.ollama_api import blueprint as ollama_blueprint

    app.register_blueprint(ollama_blueprint)  # under /api, beside Petals' /api/v1 and /api/v2
    app.register_blueprint(docs.blueprint)
    sock.init_app(app)


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

    from gateway import openai_format
    from gateway.errors import APIError, error_body, from_exception
    from gateway.openai_api import speaks_openai
    from gateway.anthropic_api import speaks_anthropic
    from gateway import anthropic_format
    from gateway import ollama_format
    from gateway.ollama_api import speaks_ollama

    # (does the request speak this API?, its error envelope), first match wins; else the Petals shape
    shapes = [
        (speaks_anthropic, anthropic_format.error_body),  # before OpenAI's, which claims every /v1 path
        (speaks_openai, openai_format.error_body),
        (speaks_ollama, ollama_format.error_body),
    ]

    @app.errorhandler(Exception)
    def api_error(error: Exception):
        """Every error of every route and hook, Flask's own 404s and 405s included: a clean message in the
        shape of the request's API, never a traceback (from_exception logs the unexpected ones)."""
        api_error: APIError = from_exception(error)
        shape = next((body for speaks, body in shapes if speaks()), error_body)
        return jsonify(shape(api_error)), api_error.status, api_error.headers()
