"""Petals Chat's HTTP API (/api/v1/...), the model list and the health checks: thin translators to the engine.

/api/v1/swarm (the swarm's health, per served model) sits on a blueprint of its own, `monitoring`, so that
the /swarm page polling it is not counted among the API's requests in /metrics.
"""

from __future__ import annotations

from flask import Blueprint, current_app, jsonify, request

from config import ModelConfig
from gateway.access import client_id
from gateway.engine import Engine, GenerationRequest
from gateway.errors import BadRequest, Unavailable, from_exception
from gateway.limits import check_context_length, check_max_length, check_new_tokens
from gateway.sampling import SamplingParams
from gateway.schemas import CloseSession, GenerationFields, HttpGenerate, OpenSession, load_json, parse

blueprint = Blueprint("petals_http", __name__)
monitoring = Blueprint("monitoring", __name__)


def get_engine() -> Engine:
    return current_app.extensions["engine"]


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


def generation_request(fields: GenerationFields, model: ModelConfig, max_new_tokens_cap: int, streaming: bool):
    """A validated request's generation fields as the engine's GenerationRequest, with the model's defaults.

    `streaming` is the WebSocket's stop_sequence mode: generation goes on until a stop sequence or the
    session's length, and max_new_tokens is the size of each streamed chunk instead of a total.
    """
    check_new_tokens("max_new_tokens", fields.max_new_tokens, max_new_tokens_cap)
    check_max_length(model, fields.max_length)
    defaults = model.defaults
    pick = lambda value, default: default if value is None else value
    sampling = SamplingParams(
        do_sample=pick(fields.do_sample, defaults.do_sample),
        temperature=pick(fields.temperature, defaults.temperature),
        top_k=pick(fields.top_k, defaults.top_k),
        top_p=pick(fields.top_p, defaults.top_p),
        repetition_penalty=pick(fields.repetition_penalty, defaults.repetition_penalty),
        seed=fields.seed,
    )
    if streaming:
        max_new_tokens = None
    elif fields.max_new_tokens is None and fields.max_length is not None:
        max_new_tokens = None  # Petals: either bound may be given; max_length alone bounds the whole text
    else:
        max_new_tokens = pick(fields.max_new_tokens, defaults.max_new_tokens)
    return GenerationRequest(
        inputs=fields.inputs,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        max_length=fields.max_length,
        stop_sequences=tuple(fields.stop_sequences()),
    )


@blueprint.post("/api/v1/generate")
def generate():
    fields = parse(HttpGenerate, request_fields())
    engine = get_engine()
    if fields.session_id:
        with engine.sessions.use(fields.session_id) as session:
            if fields.model and engine.model_config(fields.model).name != session.model.name:
                raise BadRequest(f"model: session {session.id} serves {session.model.name}", field="model")
            return _generate(engine, session, fields)

    # no session: one just big enough for this request, closed when it is answered
    config = engine.model_config(fields.model)
    request_ = generation_request(fields, config, engine.limits.max_new_tokens, streaming=False)
    prompt_length = len(engine.model(config.name).encode(fields.inputs or "", at_start=True))
    check_context_length(config, prompt_length, 0, "inputs")  # a reply cut short by the context is Petals' way
    max_length = fields.max_length or min(prompt_length + request_.max_new_tokens, config.max_session_length)
    session = engine.open_session(config.name, max(max_length, 1), expires=True, owner=client_id())
    try:
        with engine.sessions.use(session.id):
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
    session = get_engine().open_session(fields.model, fields.max_length, expires=True, owner=client_id())
    return jsonify(ok=True, session_id=session.id)


@blueprint.route("/api/v1/close_inference_session", methods=["GET", "POST"])
def close_inference_session():
    fields = parse(CloseSession, request_fields())
    engine = get_engine()
    with engine.sessions.use(fields.session_id) as session:
        engine.close_session(session)
    return jsonify(ok=True)


@blueprint.get("/api/v1/models")
def models():
    engine = get_engine()
    return jsonify(ok=True, default_model=engine.settings.gateway.default_model.name, models=engine.listed_models())


@blueprint.get("/health")
def health():
    """200 when a request to the default model could be served now; 503 with the reason when not."""
    engine = get_engine()
    name = engine.settings.gateway.default_model.name
    coverage = engine.coverage(name)
    if not coverage["covered"]:
        raise Unavailable(f"no server holds blocks {coverage['missing_blocks']} of {name}")
    return jsonify(ok=True, model=name, **coverage, open_sessions=len(engine.sessions))


@monitoring.get("/api/v1/swarm")
def swarm_health():
    """Every served model's servers and block coverage (?model=NAME for one); a model whose swarm cannot be
    reached is listed with its error, so that one broken swarm never hides the others."""
    from swarm.protocol import PROTOCOL_VERSION, dht_prefix

    engine = get_engine()
    name = request.args.get("model")
    configs = [engine.model_config(name)] if name else engine.settings.gateway.models
    listed = []
    for config in configs:
        entry = {"name": config.name, "dht_prefix": config.dht_prefix or dht_prefix(config.path)}
        try:
            entry.update(engine.swarm_health(config.name))
        except Exception as error:
            api_error = from_exception(error)
            entry.update(ok=False, error=api_error.message, code=api_error.code)
        listed.append(entry)
    return jsonify(ok=True, version=PROTOCOL_VERSION, models=listed)
