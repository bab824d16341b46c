"""Embedding models (EMBEDDING_MODELS) load before the gateway serves, not on the request path: a first load imports
sentence-transformers and the model's code (about 2 s for the shared `gateway`'s tiny encoders) and held the GIL up
to 0.3 s at a time meanwhile (measured in one process: a thread sleeping 1 ms woke 337 ms late), so that every
request then in flight, /health included, waited (240 to 275 ms were seen on /health). Each load's log line is
written outside any request (no request id: "[-]"), and a request finds nothing left to load."""

from __future__ import annotations

import re

import requests

from shared_gateways import TINY_ENCODER, TINY_RAW_ENCODER


def test_the_embedding_models_are_loaded_before_the_gateway_serves(gateway):
    for name in (TINY_ENCODER, TINY_RAW_ENCODER):
        reply = requests.post(gateway.url + "/api/embed", json={"model": name, "input": ["hello"]}, timeout=60)
        assert reply.status_code == 200 and reply.json()["load_duration"] == 0  # nothing left to load
        loaded = re.findall(rf"\[([^\]]*)\] embedding model {re.escape(name)} loaded from", gateway.log())
        assert loaded == ["-"]  # once, and by no request
