"""Petals Chat's HTTP API (/api/v1/...), the model list and the health checks: thin translators to the engine.

/api/v1/swarm (the swarm's health, per served model) sits on a blueprint of its own, `monitoring`, so that
the /swarm page polling it is not counted among the API's requests in /metrics.
"""

from __future__ import annotations

import math
import threading
import time

from flask import Blueprint, current_app, jsonify, request

from gateway.access import client_id
from gateway.current_engine import get_engine
from gateway.engine import Engine, GenerationRequest
from gateway.errors import BadRequest, Unavailable, from_exception
from gateway.limits import check_context_length
from gateway.petals_params import generation_request
from gateway.schemas import CloseSession, HttpGenerate, OpenSession, load_json, parse

blueprint = Blueprint("petals_http", __name__)
monitoring = Blueprint("monitoring", __name__)
HEALTH_COVERAGE_SECONDS = 1.0  # how long /health trusts a look at the swarm (servers' records lag 10 s anyway)


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
        with engine.sessions.use(fields.session_id) as session:
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
    coverage = current_app.extensions["health_coverage"].get(lambda: engine.coverage(name))
    if not coverage["covered"]:
        raise Unavailable(f"no server holds blocks {coverage['missing_blocks']} of {name}")
    return jsonify(ok=True, model=name, **coverage, open_sessions=len(engine.sessions))


@blueprint.record_once
def _install_health_coverage(state) -> None:
    state.app.extensions["health_coverage"] = RecentCoverage(HEALTH_COVERAGE_SECONDS)


class RecentCoverage:
    """The default model's coverage as /health last looked it up in the DHT. A lookup takes the swarm client's event
    loop and checks the records' signatures, which a busy gateway (many sessions stepping) makes slow, while a load
    balancer wants its answer at once, however often it asks: so /health answers with the last look, and a look
    older than `seconds` is renewed in the background. A look that failed, or one too old to trust (`stale`), is
    not used: that request looks again itself (and gets the error)."""

    def __init__(self, seconds: float, stale: float = 10.0):
        self.seconds, self.stale = seconds, stale
        self._value, self._looked_at, self._looking = None, -math.inf, False
        self._lock = threading.Lock()

    def get(self, look_up) -> dict:
        with self._lock:
            age = time.monotonic() - self._looked_at
            if self._value is not None and age < self.stale:
                if age >= self.seconds and not self._looking:
                    self._looking = True
                    threading.Thread(target=self._look_again, args=(look_up,), name="health-lookup",
                                     daemon=True).start()
                return self._value
        return self._look(look_up)

    def _look(self, look_up) -> dict:
        value = look_up()
        with self._lock:
            self._value, self._looked_at = value, time.monotonic()
        return value

    def _look_again(self, look_up) -> None:
        try:
            self._look(look_up)
        except Exception:  # the next /health looks itself, and answers with the error
            with self._lock:
                self._value = None
        finally:
            with self._lock:
                self._looking = False


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
