"""Petals Chat's HTTP API (/api/v1/...): generate, open and close an inference session, the model list; and
`register`, which puts this API and its WebSocket API (websocket.py) on the app.

Errors take Petals' shape (format.error_body), the gateway's default: `speaks` claims every request that no other
dialect does.
"""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from gateway.engine.generation import Engine, GenerationRequest
from gateway.engine.lengths import check_context_length
from gateway.errors import BadRequest
from gateway.petals import format as wire
from gateway.petals.schemas import CloseSession, HttpGenerate, OpenSession
from gateway.petals.translate import generation_request
from gateway.petals.websocket import blueprint as websocket_blueprint
from gateway.petals.websocket import sock
from gateway.web.access import client_id
from gateway.web.bodies import load_json, parse
from gateway.web.current_engine import get_engine

blueprint = Blueprint("petals_http", __name__)
error_body = wire.error_body


def register(app) -> None:
    app.register_blueprint(blueprint)
    app.register_blueprint(websocket_blueprint)
    sock.init_app(app)


def speaks() -> bool:
    """Petals' shape is every other request's: the pages, /health, unknown paths outside the other dialects."""
    return True


def request_fields() -> dict:
    """Query and form fields, overlaid by a JSON body when there is one (chat.petals.dev read request.values)."""
    fields = request.values.to_dict()
    body = request.get_data(cache=True)
    if body.strip() and not request.form:
        payload = load_json(body)
        if not isinstance(payload, dict):
            raise BadRequest("the JSON body must be an object")
        fields.update(payload)
    return fields


@blueprint.post("/api/v1/generate")
def generate():
    fields = parse(HttpGenerate, request_fields())
    engine = get_engine()
    if fields.session_id:
        with engine.use_session(fields.session_id, client_id()) as session:
            if fields.model and engine.model_config(fields.model).name != session.model.name:
                raise BadRequest(f"model: session {session.id} serves {session.model.name}", field="model")
            return _generate(engine, session, fields)

    # no session: one just big enough for this request, closed when it is answered
    model = engine.model(fields.model)
    config = model.config  # its context resolved: the configured one, or the model's own within the swarm's
    request_ = generation_request(fields, config, engine.limits.max_new_tokens, streaming=False)
    prompt_length = len(model.encode(fields.inputs or "", at_start=True))
    check_context_length(config, prompt_length, 0, "inputs")  # a reply cut short by the context is Petals' way
    max_length = fields.max_length or min(prompt_length + request_.max_new_tokens, config.max_session_length)
    session = engine.open_session(config.name, max(max_length, 1), expires=True, owner=client_id())
    try:
        with engine.use_session(session.id):
            return _generate(engine, session, fields, request_)
    finally:
        engine.close_session(session)


def _generate(engine: Engine, session, fields: HttpGenerate, request_: GenerationRequest | None = None):
    request_ = request_ or generation_request(fields, session.model.config, engine.limits.max_new_tokens, False)
    outputs, token_count = [], 0
    for delta in engine.generate(session, request_):
        outputs.append(delta.text)
        token_count += delta.token_count
    return jsonify(ok=True, outputs="".join(outputs), token_count=token_count)


@blueprint.route("/api/v1/open_inference_session", methods=["GET", "POST"])
def open_inference_session():
    fields = parse(OpenSession, request_fields())
    engine = get_engine()
    session = engine.open_session(fields.model, fields.max_length, expires=True, owner=client_id())
    engine.keep_session(session)  # its id continues it after a restart too (SESSION_STORE)
    return jsonify(ok=True, session_id=session.id)


@blueprint.route("/api/v1/close_inference_session", methods=["GET", "POST"])
def close_inference_session():
    fields = parse(CloseSession, request_fields())
    engine = get_engine()
    with engine.use_session(fields.session_id, client_id()) as session:
        engine.close_session(session)
    return jsonify(ok=True)


@blueprint.get("/api/v1/models")
def models():
    engine = get_engine()
    embedding_models = [{"name": encoder.name, "family": encoder.family} for encoder in engine.encoders]
    return jsonify(ok=True, default_model=engine.settings.gateway.default_model.name, models=engine.listed_models(),
                   embedding_models=embedding_models)  # apart: the chat page offers `models` for chat
