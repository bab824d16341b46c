"""Embedding models (EMBEDDING_MODELS) through real gunicorn: the shared `gateway` serves two tiny sentence-transformers
encoders beside its chat model, and the official openai and ollama clients (and Ai00's /embeds) get the vectors that
SentenceTransformer(folder).encode gives here."""

from __future__ import annotations

import base64
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import ollama
import openai
import pytest
import requests

from shared_gateways import TINY_ENCODER, TINY_RAW_ENCODER
from shared_swarm import TINY_ADAPTERS
from tiny_encoder import HIDDEN, MAX_SEQ_LENGTH

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "Привет, мир!"]
LONG = "fox " * MAX_SEQ_LENGTH  # past the encoder's max_seq_length with [CLS] and [SEP]


@pytest.fixture(scope="module")
def local(tiny_encoders):
    """sentence-transformers' own models of the two folders, by the names the gateway serves them under."""
    from sentence_transformers import SentenceTransformer

    return {folder.name: SentenceTransformer(str(folder), device="cpu", local_files_only=True)
            for folder in tiny_encoders}


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="not-needed", max_retries=0)


@pytest.fixture(scope="module")
def oll(gateway):
    return ollama.Client(host=gateway.url, timeout=120)


def close(vectors, expected) -> None:
    np.testing.assert_allclose(np.asarray(vectors, dtype=np.float32), expected, rtol=1e-4, atol=1e-5)


def test_openai_embeddings_of_an_embedding_model_equal_sentence_transformers(client, local):
    reply = client.embeddings.create(model=TINY_ENCODER, input=TEXTS)
    assert reply.model == TINY_ENCODER and [item.index for item in reply.data] == [0, 1, 2]
    close([item.embedding for item in reply.data], local[TINY_ENCODER].encode(TEXTS))
    counts = [len(ids) for ids in local[TINY_ENCODER].tokenizer(TEXTS)["input_ids"]]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(counts)
    one = client.embeddings.create(model=TINY_RAW_ENCODER, input=TEXTS[1], encoding_format="base64")
    encoded = one.data[0].embedding  # the client decodes base64 itself only when it chose the format
    vector = struct.unpack(f"<{HIDDEN}f", base64.b64decode(encoded)) if isinstance(encoded, str) else encoded
    close([vector], local[TINY_RAW_ENCODER].encode([TEXTS[1]]))


def test_dimensions_cut_and_renormalize_as_the_model_normalizes(client, local):
    full = local[TINY_ENCODER].encode(TEXTS)[:, :8]
    cut = client.embeddings.create(model=TINY_ENCODER, input=TEXTS, dimensions=8)
    close([item.embedding for item in cut.data], full / np.linalg.norm(full, axis=1, keepdims=True))
    raw = client.embeddings.create(model=TINY_RAW_ENCODER, input=TEXTS, dimensions=8)
    close([item.embedding for item in raw.data], local[TINY_RAW_ENCODER].encode(TEXTS)[:, :8])


def test_ollama_embed_is_normalized_and_the_older_route_is_the_models_own(oll, local):
    reply = oll.embed(model=TINY_RAW_ENCODER, input=TEXTS)
    assert reply.model == TINY_RAW_ENCODER and reply.prompt_eval_count > len(TEXTS)
    close(reply.embeddings, local[TINY_RAW_ENCODER].encode(TEXTS, normalize_embeddings=True))
    close(oll.embed(model=TINY_ENCODER + ":latest", input=TEXTS[0]).embeddings, local[TINY_ENCODER].encode(TEXTS[:1]))
    older = oll.embeddings(model=TINY_RAW_ENCODER, prompt=TEXTS[2]).embedding
    close([older], local[TINY_RAW_ENCODER].encode(TEXTS[2:]))
    # an input past max_seq_length is cut, as sentence-transformers cuts it, unless truncate is false
    close(oll.embed(model=TINY_ENCODER, input=LONG).embeddings, local[TINY_ENCODER].encode([LONG]))
    with pytest.raises(ollama.ResponseError) as refused:
        oll.embed(model=TINY_ENCODER, input=["x", LONG], truncate=False)
    assert refused.value.status_code == 400 and "input[1]" in refused.value.error


def test_ai00_embeds_chunks_each_text_and_embeds_each_chunk_after_the_prefix(gateway, local):
    text = "The quick brown fox jumps over the lazy dog. A swarm of block servers answers every step."
    reply = requests.post(gateway.url + "/api/oai/embeds", json={"input": text, "max_tokens": 6,
                                                                 "model": TINY_ENCODER}, timeout=60)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "embeds" and body["model"] == TINY_ENCODER
    [item] = body["data"]
    assert item["object"] == "embed" and item["index"] == 0 and len(item["chunks"]) > 2
    chunks = [chunk["chunk"] for chunk in item["chunks"]]
    assert "".join(chunks) == text
    tokenizer = local[TINY_ENCODER].tokenizer
    assert all(len(tokenizer(chunk, add_special_tokens=False)["input_ids"]) <= 6 for chunk in chunks)
    close([chunk["embed"][0] for chunk in item["chunks"]],
          local[TINY_ENCODER].encode(["query:" + chunk for chunk in chunks]))
    default = requests.post(gateway.url + "/v1/embeds", json={"input": "hello world", "prefix": ""}, timeout=60).json()
    assert default["model"] == TINY_ENCODER  # the first embedding model when none is named
    close([default["data"][0]["chunks"][0]["embed"][0]], local[TINY_ENCODER].encode(["hello world"]))


def test_embedding_models_are_listed_and_marked(client, oll, gateway):
    listed = {model.id: model for model in client.models.list().data}
    chat_models = ["tiny", *(f"tiny:{adapter}" for adapter in TINY_ADAPTERS)]  # and its LoRA adapters
    assert list(listed) == [*chat_models, TINY_ENCODER, TINY_RAW_ENCODER]
    assert listed["tiny"].owned_by == "swarm"
    assert listed[TINY_ENCODER].owned_by == "gateway" and listed[TINY_ENCODER].model_extra["type"] == "embeddings"
    tags = {model.model: model for model in oll.list().models}
    assert list(tags) == [*chat_models, TINY_ENCODER, TINY_RAW_ENCODER] and tags[TINY_ENCODER].details.family == "bert"
    shown = oll.show(TINY_ENCODER)
    assert shown.capabilities == ["embedding"] and shown.details.family == "bert"
    assert shown.modelinfo["bert.embedding_length"] == HIDDEN and shown.modelinfo["bert.context_length"] == MAX_SEQ_LENGTH
    petals = requests.get(gateway.url + "/api/v1/models").json()
    assert [model["name"] for model in petals["models"]] == chat_models  # what the chat page offers for chat
    assert [model["name"] for model in petals["embedding_models"]] == [TINY_ENCODER, TINY_RAW_ENCODER]


def test_concurrent_requests_each_get_their_own_vectors(client, local):
    """Requests on one encoder from many threads at once (its tokenizer is not safe to share unguarded)."""
    expected = local[TINY_ENCODER].encode(TEXTS)

    def embed(index: int):
        return index, client.embeddings.create(model=TINY_ENCODER, input=TEXTS[index % 3]).data[0].embedding

    with ThreadPoolExecutor(6) as pool:
        for index, vector in pool.map(embed, range(12)):
            close([vector], expected[index % 3 : index % 3 + 1])


@pytest.mark.parametrize("body, status, param, says", [
    ({"model": "nope", "input": "x"}, 404, "model", "unknown model 'nope'"),
    ({"model": TINY_ENCODER, "input": ""}, 400, "input", "must not be empty"),
    ({"model": TINY_ENCODER, "input": []}, 400, "input", "must not be empty"),
    ({"model": TINY_ENCODER, "input": ["a", ""]}, 400, "input[1]", "must not be empty"),
    ({"model": TINY_ENCODER, "input": ["a"] * 2049}, 400, "input", "at most 2048 inputs in one request, got 2049"),
    ({"model": TINY_ENCODER, "input": [1, 2, 3]}, 400, "input", "takes text, not token ids"),
    ({"model": TINY_ENCODER, "input": ["ok", LONG]}, 400, "input[1]", f"more than the {MAX_SEQ_LENGTH} that"),
    ({"model": TINY_ENCODER, "input": LONG}, 400, "input", f"more than the {MAX_SEQ_LENGTH} that"),
    ({"model": TINY_ENCODER, "input": "x", "dimensions": HIDDEN + 1}, 400, "dimensions", f"at most {HIDDEN}"),
    ({"model": TINY_ENCODER, "input": "x", "layer": 1}, 400, "layer", "is an embedding model"),
])
def test_bad_embedding_requests_get_the_routes_errors(gateway, body, status, param, says):
    reply = requests.post(gateway.url + "/v1/embeddings", json=body, timeout=60)
    error = reply.json()["error"]
    assert reply.status_code == status and error["param"] == param and says in error["message"], reply.text


def test_generation_naming_an_embedding_model_is_a_400_naming_model(client, oll, gateway):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=TINY_ENCODER, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["param"] == "model" and "is an embedding model" in refused.value.body["message"]
    with pytest.raises(ollama.ResponseError) as refused:
        oll.generate(model=TINY_ENCODER + ":latest", prompt="hi", stream=False)
    assert refused.value.status_code == 400 and "is an embedding model" in refused.value.error
    embeds = requests.post(gateway.url + "/v1/embeds", json={"input": "x", "model": "tiny"}, timeout=60)
    assert embeds.status_code == 400 and "'tiny' is not an embedding model" in embeds.json()["error"]["message"]
