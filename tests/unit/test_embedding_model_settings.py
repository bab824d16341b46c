"""EMBEDDING_MODELS: the setting's parsing (config.py), the start-up check of each folder, and the encoder wrapper
(gateway/engine/encoders.py) against sentence-transformers itself on a tiny random-weight BERT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from config import EmbeddingModelConfig, GatewaySettings, ModelConfig, Settings, SwarmSettings
from gateway.engine.encoders import EmbeddingModelError, EmbeddingModels, Encoder, check_folder
from gateway.errors import BadRequest, LengthExceeded
from tiny_encoder import MAX_SEQ_LENGTH, build_tiny_encoder

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "a swarm of block servers"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("encoders")
    return build_tiny_encoder(base / "unit-encoder"), build_tiny_encoder(base / "unit-raw", normalize=False, seed=1)


@pytest.fixture(scope="module")
def local(folders):
    """sentence-transformers' own models of the two folders: what the gateway must equal."""
    from sentence_transformers import SentenceTransformer

    return [SentenceTransformer(str(folder), device="cpu", local_files_only=True) for folder in folders]


def encoder(folder: Path) -> Encoder:
    return Encoder(EmbeddingModelConfig.from_folder(str(folder)), "cpu")


# ------------------------------------------------------------------------------------------ the setting


def test_the_setting_lists_folders_served_under_their_names(tmp_path):
    settings = GatewaySettings.from_env({"EMBEDDING_MODELS": f" {tmp_path}/a-1,{tmp_path}/b.2  ~/c_3/ ",
                                         "SESSION_STORE": "off"})
    assert [model.name for model in settings.embedding_models] == ["a-1", "b.2", "c_3"]
    assert settings.embedding_models[0].folder == tmp_path / "a-1"
    assert settings.embedding_models[2].folder == Path.home() / "c_3"
    assert GatewaySettings.from_env({"SESSION_STORE": "off"}).embedding_models == ()


@pytest.mark.parametrize("value, complaint", [
    ("/models/.hidden", "folder's name"),
    ("/models/bad!name", "folder's name"),
    ("/a/enc /b/enc", "already taken"),
    ("/models/tiny", "already taken"),  # the chat model's name
])
def test_a_bad_setting_is_a_clear_error_naming_it(value, complaint):
    environ = {"EMBEDDING_MODELS": value, "MODEL": "/models/tiny", "SESSION_STORE": "off"}
    with pytest.raises(ValueError, match=f"EMBEDDING_MODELS: .*{complaint}"):
        GatewaySettings.from_env(environ)


# ------------------------------------------------------------------------------------------ the start-up check


def test_each_folder_is_checked_when_the_engine_is_built(tmp_path, folders):
    from gateway.engine.generation import Engine

    not_a_model = tmp_path / "plain"
    not_a_model.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "modules.json").write_text("{not json")
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "modules.json").write_text(json.dumps([{"path": "1_Pooling", "type": "Pooling"}]))
    cases = [(tmp_path / "absent", "is not a readable folder"), (not_a_model, "not a sentence-transformers model "
             "folder \\(no modules.json\\)"), (broken, "unreadable or malformed"), (incomplete, "missing .*1_Pooling")]
    for folder, message in cases:
        with pytest.raises(EmbeddingModelError, match=f"EMBEDDING_MODELS: {folder}.*{message}"):
            check_folder(EmbeddingModelConfig.from_folder(str(folder)))
    gateway = GatewaySettings(models=(ModelConfig(name="tiny", path="tiny"),),
                              embedding_models=(EmbeddingModelConfig.from_folder(str(not_a_model)),))
    with pytest.raises(EmbeddingModelError):
        Engine(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway), connect=lambda config: None)
    check_folder(EmbeddingModelConfig.from_folder(str(folders[0])))  # the real thing passes


def test_the_gateway_does_not_start_on_a_folder_it_cannot_serve(tmp_path):
    """app.py's one line, and gunicorn's status for "do not start the worker again" (APP_LOAD_ERROR)."""
    environ = {**os.environ, "EMBEDDING_MODELS": str(tmp_path), "SESSION_STORE": "off", "MODEL": "/models/tiny"}
    done = subprocess.run([sys.executable, "-c", "import app"], cwd=ROOT, env=environ, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 4
    assert f"error: EMBEDDING_MODELS: {tmp_path} is not a sentence-transformers model folder" in done.stderr
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------------------------------ the encoder


def test_vectors_equal_sentence_transformers_own(folders, local):
    for folder, model in zip(folders, local):
        vectors = encoder(folder).encode(TEXTS)
        np.testing.assert_allclose(vectors, model.encode(TEXTS), rtol=1e-5, atol=1e-6)
    assert encoder(folders[0]).normalizes and not encoder(folders[1]).normalizes


def test_dimensions_cut_and_renormalize_only_a_normalizing_model(folders, local):
    normalizing, raw = encoder(folders[0]), encoder(folders[1])
    cut = np.array(normalizing.encode(TEXTS, dimensions=8))
    full = local[0].encode(TEXTS)
    np.testing.assert_allclose(cut, full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(raw.encode(TEXTS, dimensions=8), local[1].encode(TEXTS)[:, :8], rtol=1e-5, atol=1e-6)
    unit = np.array(raw.encode(TEXTS, normalize=True))  # Ollama's /api/embed: unit vectors whatever the model does
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, rtol=1e-5)
    with pytest.raises(BadRequest, match="dimensions: at most 32 for unit-encoder, got 33") as error:
        normalizing.encode(TEXTS, dimensions=33)
    assert error.value.field == "dimensions"


def test_tokens_are_counted_and_checked_as_the_encoder_reads_them(folders, local):
    tiny = encoder(folders[0])
    counts = tiny.token_counts(TEXTS)
    assert counts == [len(local[0].tokenizer(text)["input_ids"]) for text in TEXTS]
    assert tiny.max_tokens == MAX_SEQ_LENGTH
    tiny.check_fits(counts, "input")
    with pytest.raises(LengthExceeded, match=f"input\\[1\\]: {MAX_SEQ_LENGTH + 1} tokens, more than the "
                                             f"{MAX_SEQ_LENGTH} that unit-encoder reads") as error:
        tiny.check_fits([3, MAX_SEQ_LENGTH + 1], "input")
    assert error.value.field == "input[1]"
    with pytest.raises(LengthExceeded, match="prompt: 99 tokens") as error:
        tiny.check_fits([99], "prompt", listed=False)
    assert error.value.field == "prompt"


def test_chunks_cover_the_text_in_pieces_of_at_most_size_tokens(folders):
    tiny = encoder(folders[0])
    text = "The quick brown fox jumps over the lazy dog. Hello, world!"
    chunks = tiny.chunks(text, 3)
    assert "".join(chunks) == text and len(chunks) > 3
    assert all(count <= 3 + 2 for count in tiny.token_counts(chunks))  # [CLS] and [SEP] besides
    assert tiny.chunks(text, 1000) == [text] and tiny.chunks("   ", 3) == []


def test_names_pick_encoders_and_chat_requests_naming_one_are_refused(folders):
    models = EmbeddingModels(tuple(EmbeddingModelConfig.from_folder(str(folder)) for folder in folders))
    assert [encoder.name for encoder in models] == ["unit-encoder", "unit-raw"] and len(models) == 2
    assert models.get("unit-raw").name == "unit-raw" and models.get("tiny") is None and models.get(None) is None
    assert models.first(None).name == "unit-encoder" and models.first("unit-raw").name == "unit-raw"
    with pytest.raises(BadRequest, match="model: 'tiny' is not an embedding model; embedding models served: "
                                         "unit-encoder, unit-raw"):
        models.first("tiny")
    with pytest.raises(BadRequest, match="model: no embedding model is served here"):
        EmbeddingModels(()).first(None)
    with pytest.raises(BadRequest, match="model: 'unit-raw' is an embedding model") as error:
        models.refuse_chat("unit-raw")
    assert error.value.field == "model"
    models.refuse_chat("tiny")
    models.refuse_chat(None)
