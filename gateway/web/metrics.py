"""The gateway's Prometheus metrics, and GET /metrics (Prometheus text format).

    gateway_open_sessions                       gauge      HTTP and WebSocket sessions open now
    gateway_open_websockets                     gauge      WebSocket connections open now (MAX_WEBSOCKETS)
    gateway_warm_sessions                       gauge      finished conversations kept on the servers (WARM_SESSIONS)
    gateway_saved_states                        gauge      prefixes saved by name (POST /v1/states)
    gateway_cached_prompt_tokens_total{model}   counter    prompt tokens the servers held already: never computed
    gateway_draft_tokens_total{model}           counter    tokens drafted for speculative decoding (engine/speculation.py)
    gateway_draft_tokens_accepted_total{model}  counter    of those, the ones kept: the acceptance rate is their ratio
    gateway_requests_total{api, status}         counter    api: petals_http, petals_ws, openai, anthropic, ollama;
                                                           status: HTTP code
    gateway_time_to_first_token_seconds{model}  histogram  from a generation's start to its first token
    gateway_inter_token_latency_seconds{model}  histogram  between two tokens of one generation
    gateway_generated_tokens_total{model}       counter    rate() of it is the gateway's tokens/s
    swarm_client_retries_total, swarm_client_failovers_total   the swarm client's (swarm/client/metrics.py)
    swarm_step_stage_seconds_total{stage, blocks}  counter  where steps' time goes (swarm/client/stage_clock.py),
    swarm_step_stage_events_total{stage, blocks}   counter  over this many steps
    python_gc_frozen_objects                    gauge      objects out of the collector's way (swarm/gc_tuning.py)

Hooks are central: an after_request counts every HTTP reply, petals/websocket.py counts each WebSocket message once
(with the status its reply carries), and Engine.generate times tokens (engine/metrics.py, where the token metrics
live: the engine never imports Flask). gunicorn runs one worker process, so prometheus_client's default registry
holds everything.
"""

from __future__ import annotations

from flask import Response, request
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, generate_latest

import gateway.engine.metrics  # noqa: F401  (registers the token metrics, even before a first generation)
import swarm.client  # noqa: F401  (registers the swarm client's counters, even before a client exists)
from swarm.gc_tuning import expose as expose_gc
from swarm.client import stage_clock

OPEN_SESSIONS = Gauge("gateway_open_sessions", "Inference sessions open on this gateway, HTTP and WebSocket")
OPEN_WEBSOCKETS = Gauge("gateway_open_websockets", "WebSocket connections open on this gateway")
WARM_SESSIONS = Gauge("gateway_warm_sessions", "Finished conversations kept open on the servers for reuse")
SAVED_STATES = Gauge("gateway_saved_states", "Prefixes saved by name, forked by the requests starting with them")
REQUESTS = Counter("gateway_requests_total", "API requests (WebSocket: messages) by API and status code",
                   ["api", "status"])
expose_gc(REGISTRY)


def install(app) -> None:
    """Count every HTTP reply of the Flask app by API and status, and serve /metrics."""
    stage_clock.expose()

    @app.get("/metrics")
    def metrics():
        OPEN_SESSIONS.set(len(app.extensions["engine"].sessions))  # read at scrape time: never stale
        OPEN_WEBSOCKETS.set(len(app.extensions["websocket_slots"]))
        WARM_SESSIONS.set(len(app.extensions["engine"].warm))
        SAVED_STATES.set(len(app.extensions["engine"].states))
        return Response(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)

    @app.after_request
    def count_request(response):
        api = api_of(request.blueprint)
        if api is not None and api != "petals_ws":  # a WebSocket counts its messages, not its upgrade
            REQUESTS.labels(api, str(response.status_code)).inc()
        return response


API_BLUEPRINTS = ("openai", "anthropic", "ollama")  # the API label of the blueprints whose names start with it


def api_of(blueprint_name) -> str | None:
    """The API label of a blueprint; None for the routes not counted (docs, static files, pages, /metrics)."""
    if blueprint_name in ("petals_http", "petals_ws"):
        return blueprint_name
    # a blueprint per API (and per prefix: openai_v1, openai_api_oai, ...): named by what it starts with
    return next((api for api in API_BLUEPRINTS if blueprint_name and blueprint_name.startswith(api)), None)


def count_ws_message(status: int) -> None:
    REQUESTS.labels("petals_ws", str(status)).inc()

