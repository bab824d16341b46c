"""The gateway's health, for load balancers and people: GET /health (can the default model be served now?) and
GET /api/v1/swarm (every served model's servers and block coverage: what the /swarm page draws).

Both sit on a blueprint of their own, `monitoring`, so that pollers (a load balancer, the /swarm page) are not
counted among the APIs' requests in /metrics.
"""

from __future__ import annotations

import math
import threading
import time

from flask import Blueprint, current_app, jsonify, request

from gateway.errors import Unavailable, from_exception
from gateway.web.current_engine import get_engine

blueprint = Blueprint("monitoring", __name__)
HEALTH_COVERAGE_SECONDS = 1.0  # how long /health trusts a look at the swarm (servers' records lag 10 s anyway)


@blueprint.get("/health")
def health():
    """200 when a request to the default model could be served now; 503 with the reason when not."""
    engine = get_engine()
    name = engine.settings.gateway.default_model.name
    coverage = current_app.extensions["health_coverage"].get(lambda: engine.coverage(name))
    if not coverage["covered"]:
        raise Unavailable(f"no server holds blocks {coverage['missing_blocks']} of {name}")
    return jsonify(ok=True, model=name, **coverage, open_sessions=engine.open_sessions)


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


@blueprint.get("/api/v1/swarm")
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
            entry.update(_with_protocols(engine.swarm_health(config.name)))
        except Exception as error:
            api_error = from_exception(error)
            entry.update(ok=False, error=api_error.message, code=api_error.code)
        listed.append(entry)
    return jsonify(ok=True, version=PROTOCOL_VERSION, models=listed)


def _with_protocols(health: dict) -> dict:
    """Each server marked with whether the gateway speaks its protocol (those it does not are never routed to),
    and how many do not: an operator upgrading servers one at a time sees which lag."""
    from swarm.client import speaks

    for server in health["servers"]:
        server["compatible"] = speaks(server["version"])
    return {**health, "incompatible_servers": sum(not server["compatible"] for server in health["servers"])}
