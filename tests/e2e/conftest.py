"""The two gunicorn gateways in front of the shared tiny swarm that the e2e tests share, one per pytest worker
(their settings: tests/shared_gateways.py). A test that needs a gateway configured otherwise starts its own with
gunicorn_gateway.running_gateway."""

from __future__ import annotations

import json

import pytest

from gunicorn_gateway import running_gateway
from shared_gateways import (STRICT_CONTEXT, STRICT_KEYS, STRICT_LIMITS, STRICT_ORIGIN, TINY_ENCODER,
                             TINY_HEADER_TIMEOUT, TINY_IDLE_TIMEOUT, TINY_MAX_SESSION_LENGTH, TINY_MAX_SESSIONS,
                             TINY_RAW_ENCODER)
from shared_swarm import TINY_PREFIX
from tiny_encoder import build_tiny_encoder


@pytest.fixture(scope="session")
def tiny_encoders(tmp_path_factory):
    """The `gateway`'s two embedding models, as sentence-transformers folders: (normalizing, not normalizing). Cheap:
    loaded by the gateway only when a request names one."""
    folder = tmp_path_factory.mktemp("encoders")
    return (build_tiny_encoder(folder / TINY_ENCODER), build_tiny_encoder(folder / TINY_RAW_ENCODER, normalize=False))


@pytest.fixture(scope="session")
def gateway(tiny_swarm, tiny_llama, tiny_encoders, tmp_path_factory):
    """gunicorn in front of the tiny swarm, with a small cap on sessions and a short idle timeout, and two embedding
    models beside the chat model; no API keys, and on loopback: its callers are one trusted user by default
    (KEYLESS_SHARING unset, as `make run` leaves it)."""
    models = [{"name": "tiny", "path": str(tiny_llama), "dht_prefix": TINY_PREFIX, "max_session_length": TINY_MAX_SESSION_LENGTH}]
    env = {
        "INITIAL_PEERS": " ".join(tiny_swarm.initial_peers),
        "MODELS": json.dumps(models),
        "MAX_SESSIONS": str(TINY_MAX_SESSIONS),
        "SESSION_IDLE_TIMEOUT": str(TINY_IDLE_TIMEOUT),
        "HTTP_HEADER_TIMEOUT": str(TINY_HEADER_TIMEOUT),
        "MAX_NEW_TOKENS": "200",
        "WS_PING_INTERVAL": "1",
        "EMBEDDING_MODELS": " ".join(str(folder) for folder in tiny_encoders),
    }
    with running_gateway(env, tmp_path_factory.mktemp("gateway")) as server:
        yield server


@pytest.fixture(scope="session")
def strict_gateway(tiny_swarm, tiny_llama, tmp_path_factory):
    """gunicorn in front of the tiny swarm configured tight: API keys, an origin allowlist, small limits."""
    models = [{"name": "tiny", "path": str(tiny_llama), "dht_prefix": TINY_PREFIX, "max_session_length": STRICT_CONTEXT}]
    env = {"INITIAL_PEERS": " ".join(tiny_swarm.initial_peers), "MODELS": json.dumps(models),
           "API_KEYS": ",".join(STRICT_KEYS), "ALLOWED_ORIGINS": STRICT_ORIGIN, "LOG_LEVEL": "INFO",
           **{name: str(value) for name, value in STRICT_LIMITS.items()}}
    with running_gateway(env, tmp_path_factory.mktemp("strict-gateway")) as server:
        yield server



def pytest_collection_modifyitems(items):
    """schemathesis names each fuzzing item after its operation ("test_http_apis_survive_fuzzing[POST /v1/...]"), but
    under pytest 9 all of them get one node id (pytest builds it from `originalname`, which schemathesis sets to the
    bare test name), and pytest-xdist cannot tell them apart: under `make test` they were collected and never run.
    Each gets the node id its name says, as pytest's own Node would build it (there is no public setter)."""
    for item in items:
        if type(item).__name__ == "SchemathesisFunction" and item.nodeid != f"{item.parent.nodeid}::{item.name}":
            item._id = item.parent.id.child(item.name)
