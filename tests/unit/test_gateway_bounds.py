"""What one client's request may make the gateway hold: Ai00's /embeds counts its chunks and caps the copies of its
prefix before making one (issue 32, item 5)."""

from __future__ import annotations

import tracemalloc

import pytest

from config import GatewaySettings, Limits, ModelConfig, Settings, SwarmSettings
from gateway import create_app


class WordEncoder:
    """An encoder whose tokens are words, with [CLS] and [SEP] around each input, as a BERT's are."""

    name, max_tokens = "words", 512

    def token_counts(self, texts):
        return [len(text.split()) + 2 for text in texts]

    def chunks(self, text, size):
        words = text.split()
        return [" ".join(words[start:start + size]) for start in range(0, len(words), size)]

    def encode(self, texts, dimensions=None, normalize=False):
        return [[float(len(text))] for text in texts]


class OneEncoder:
    def __init__(self):
        self.encoder = WordEncoder()

    def first(self, name):
        return self.encoder

    def get(self, name):
        return None

    def refuse_chat(self, name):
        pass


@pytest.fixture
def client(tmp_path):
    gateway = GatewaySettings(models=(ModelConfig("m", "m"),))
    app = create_app(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway))
    app.extensions["engine"].encoders = OneEncoder()
    return app.test_client()


def posted_with_peak(client, body: dict):
    """The reply, and the most memory Python held while the gateway answered it."""
    tracemalloc.start()
    try:
        reply = client.post("/v1/embeds", json=body)
        return reply, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("chunks, field, says", [(4000, "input", "MAX_INPUTS_PER_REQUEST"),
                                                  (1000, "prefix", "MAX_BODY_BYTES")])
def test_embeds_counts_its_chunks_and_caps_the_prefixs_copies_before_making_them(client, chunks, field, says):
    """A 20 KB prefix before each of a text's one-word chunks: 4,000 of them were 80 MB of strings made before they
    were counted (a 1 MiB body: tens of GB), 1,000 were 20 MB made and embedded; now each is refused first, naming
    the field and the limit, and the request holds little more than its body."""
    body = {"input": "word " * chunks, "max_tokens": 1, "prefix": "x" * 20_000}
    refused, peak = posted_with_peak(client, body)
    assert peak < 8 << 20, f"{peak / 2 ** 20:.0f} MiB held for a {20 + chunks * 5 // 1000} KB request"
    assert refused.status_code == 400 and refused.json["error"]["param"] == field
    assert says in refused.json["error"]["message"] and str(chunks) in refused.json["error"]["message"]
    fine = client.post("/v1/embeds", json={"input": "a b c d e", "max_tokens": 2, "prefix": "q:"})
    assert fine.status_code == 200 and [chunk["chunk"] for chunk in fine.json["data"][0]["chunks"]] == \
        ["a b", "c d", "e"]


def test_a_prefix_that_leaves_no_room_for_a_chunk_is_refused(client):
    refused = client.post("/v1/embeds", json={"input": "a b", "prefix": "p " * 510})
    assert refused.status_code == 400 and refused.json["error"]["param"] == "prefix"
    assert "512 tokens" in refused.json["error"]["message"] and "no room" in refused.json["error"]["message"]


def test_an_unknown_session_id_is_echoed_only_in_part(client):
    """A 100,000-character id came back whole in the 404 (item 10)."""
    long_id = "A" * 100_000
    for path in ("/api/v1/generate", "/api/v1/close_inference_session"):
        unknown = client.post(path, json={"session_id": long_id, "inputs": "hi"})
        assert unknown.status_code == 404, unknown.json
        assert len(unknown.data) < 1000 and "A" * 64 in unknown.json["error"], len(unknown.data)
    short = client.post("/api/v1/close_inference_session", json={"session_id": "no-such-id"})
    assert "'no-such-id'" in short.json["error"]
