"""Models named by their Hugging Face Hub id (swarm/hub.py), fetched in this process from a local Hub
(tests/local_hub.py) that counts what it sends: a span fetches only the weight files that hold its blocks, a client
only those of its embeddings, final norm and LM head; a second start fetches no file; a cut download resumes with a
Range request; HF_HUB_OFFLINE=1 serves from the cache; HF_TOKEN opens a gated model; and each refusal is one line
that says what to do. Real servers and a gateway on a Hub model: tests/e2e/test_hub_model_served.py."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple

import pytest
import torch

import local_hub
from local_hub import LocalHub
from processes import free_port, run_tool
from swarm.client.head import load_client
from swarm.protocol import UnknownModelError
from swarm.server.span import load_span
from swarm.weights import fetch_client_files, load_tensors, resolve_model
from tiny_model import build_tiny_model

REPO, GATED, TIED, UNSERVED = "tiny-org/tiny-llama", "tiny-org/gated-llama", "tiny-org/tiny-gpt2", "tiny-org/neo"
SMALL_FILES = {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja"}
DiskUsage = namedtuple("DiskUsage", "total used free")
BOGUS_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWRzzgPQQS3Z3gKbcainfUKGvvRv1vjhyvf9NVGzGidZAY"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The local folders the Hub serves: 8 Llama blocks in 8 weight files, and a tied GPT-2 in several."""
    root = tmp_path_factory.mktemp("hub-models")
    llama = build_tiny_model(root / "llama", "llama", 8, max_shard_size="200KB")
    gpt2 = build_tiny_model(root / "gpt2", "gpt2", 2, max_shard_size="200KB")
    neo = root / "neo"
    neo.mkdir()
    (neo / "config.json").write_text(json.dumps({"model_type": "gpt_neo", "num_layers": 2}))
    (neo / "model.safetensors").write_bytes(b"\0" * 4096)
    return namedtuple("Models", "llama gpt2 neo")(llama, gpt2, neo)


@pytest.fixture(scope="module")
def hub(models):
    hub = LocalHub().start()
    hub.add(REPO, models.llama)
    hub.add(GATED, models.llama, gated=True)
    hub.add(TIED, models.gpt2)
    hub.add(UNSERVED, models.neo)
    yield hub
    hub.stop()


@pytest.fixture
def cache(hub, tmp_path, monkeypatch):
    """An empty Hub cache, this process's huggingface_hub pointed at the local Hub, its requests counted from here."""
    local_hub.use_in_this_process(monkeypatch, hub.url, tmp_path / "hub")
    hub.clear()
    return tmp_path / "hub"


def files_of(folder, *prefixes) -> set[str]:
    """The weight files holding the tensors named by these prefixes, from the model's own index."""
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    return {file for name, file in weight_map.items() if name.startswith(prefixes) or name in prefixes}


def weight_gets(hub, repo=REPO) -> dict[str, int]:
    return {name: sent for name, sent in hub.file_gets(repo).items() if name.endswith(".safetensors")}


def test_a_span_of_2_of_8_blocks_fetches_only_its_files_and_a_second_start_none(hub, models, cache):
    folder = resolve_model(REPO, cache)
    assert set(hub.file_gets(REPO)) == SMALL_FILES and not weight_gets(hub)  # no weights before a span is chosen
    span = load_span(folder, 2, 4)
    wanted = files_of(models.llama, "model.layers.2.", "model.layers.3.")
    assert wanted == {"model-00003-of-00008.safetensors", "model-00004-of-00008.safetensors"}
    assert weight_gets(hub) == {name: (models.llama / name).stat().st_size for name in wanted}  # each once, whole
    assert {request.method for request in hub.requests if request.path.endswith("safetensors")} == {"HEAD", "GET"}
    local = load_tensors(models.llama, lambda name: name.startswith(("model.layers.2.", "model.layers.3.")))
    assert span.loaded_names == sorted(local)
    for name, tensor in load_tensors(folder, lambda name: name in local).items():
        assert torch.equal(tensor, local[name])

    hub.clear()
    assert resolve_model(REPO, cache) == folder
    load_span(folder, 2, 4)
    assert not [request for request in hub.requests if request.method == "GET" and "/resolve/" in request.path]


def test_a_client_fetches_only_its_embeddings_norm_and_head(hub, models, cache):
    fetch_client_files(REPO, cache)
    assert set(weight_gets(hub)) == files_of(models.llama, "model.embed_tokens.weight", "model.norm.weight",
                                             "lm_head.weight") == {"model-00001-of-00008.safetensors",
                                                                   "model-00007-of-00008.safetensors",
                                                                   "model-00008-of-00008.safetensors"}
    hub.clear()
    client = load_client(resolve_model(REPO, cache))
    assert not weight_gets(hub) and "lm_head.weight" in client.loaded_names


def test_a_draft_model_is_fetched_whole(hub, models, cache):
    resolve_model(REPO, cache, whole=True)
    assert set(weight_gets(hub)) == files_of(models.llama, "") and len(weight_gets(hub)) == 8


def test_a_tied_head_is_the_embeddings_file(hub, models, cache):
    fetch_client_files(TIED, cache)
    index = json.loads((models.gpt2 / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in index  # tied: the head is the token embeddings
    assert set(weight_gets(hub, TIED)) == files_of(models.gpt2, "transformer.wte.", "transformer.wpe.",
                                                   "transformer.ln_f.")
    assert len(weight_gets(hub, TIED)) < len(set(index.values()))


def test_a_cut_download_resumes_where_it_stopped(hub, models, cache, monkeypatch):
    """huggingface_hub writes what it received in chunks of DOWNLOAD_CHUNK_SIZE (10 MB) and resumes from the last
    whole chunk: 1 KB ones here, so that a 199 KB file cut halfway resumes past its first 97 KB."""
    monkeypatch.setattr("huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE", 1024)
    name = "model-00003-of-00008.safetensors"
    hub.cut_next(name)
    span = load_span(resolve_model(REPO, cache), 2, 3)
    gets = [request for request in hub.requests if request.method == "GET" and request.path.endswith(name)]
    size, kept = (models.llama / name).stat().st_size, (models.llama / name).stat().st_size // 2 // 1024 * 1024
    assert [(request.status, request.range, request.body_bytes) for request in gets] == [
        (200, None, size // 2), (206, f"bytes={kept}-", size - kept)]
    local = load_tensors(models.llama, lambda name: name.startswith("model.layers.2."))
    assert all(torch.equal(tensor, local[name]) for name, tensor in
               load_tensors(span_folder(cache), lambda name: name in local).items())


def test_a_gated_model_needs_hf_token(hub, cache, monkeypatch):
    with pytest.raises(UnknownModelError) as refused:
        resolve_model(GATED, cache)
    assert one_line(refused) and "gated" in str(refused.value) and "HF_TOKEN" in str(refused.value)
    monkeypatch.setenv("HF_TOKEN", local_hub.TOKEN)
    load_span(resolve_model(GATED, cache), 0, 1)


def test_offline_the_cache_alone_serves(models, tmp_path, monkeypatch):
    own = LocalHub().start()  # a Hub of its own, stopped once the span is fetched: nothing listens there then
    own.add(REPO, models.llama)
    local_hub.use_in_this_process(monkeypatch, own.url, tmp_path / "hub")
    folder = resolve_model(REPO, tmp_path / "hub")
    load_span(folder, 2, 4)
    own.stop()
    assert resolve_model(REPO, tmp_path / "hub") == folder  # online, the Hub out of reach: the cache as it is
    load_span(folder, 2, 4)
    with pytest.raises(UnknownModelError, match="cannot reach the Hugging Face Hub") as refused:
        load_span(folder, 0, 1)  # not fetched while the Hub was there
    assert one_line(refused)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert resolve_model(REPO, tmp_path / "hub") == folder
    load_span(folder, 2, 4)
    with pytest.raises(UnknownModelError, match="HF_HUB_OFFLINE=1") as refused:
        load_span(folder, 0, 1)
    assert one_line(refused)


@pytest.mark.parametrize("name, revision, message", [
    ("tiny-org/no-such-model", "main", "unknown model 'tiny-org/no-such-model': no such local folder, nor model"),
    (REPO, "v9", "tiny-org/tiny-llama has no revision 'v9': give --revision a branch, tag or commit"),
    (UNSERVED, "main", "tiny-org/neo: model type 'gpt_neo' is not supported (supported: llama"),
])
def test_what_cannot_be_fetched_is_one_line_before_any_weight(hub, cache, name, revision, message):
    with pytest.raises(UnknownModelError) as refused:
        resolve_model(name, cache, revision)
    assert one_line(refused) and message in str(refused.value)
    assert set(hub.file_gets(name)) <= {"config.json"}  # the family is checked on the config alone


def test_no_room_on_the_disk_is_told_before_the_download(hub, models, cache, monkeypatch):
    folder = resolve_model(REPO, cache)
    hub.clear()
    monkeypatch.setattr("swarm.hub.shutil.disk_usage", lambda path: DiskUsage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(UnknownModelError) as refused:
        load_span(folder, 2, 4)
    needed = sum((models.llama / name).stat().st_size for name in files_of(models.llama, "model.layers.2.",
                                                                           "model.layers.3."))
    assert one_line(refused) and f"take {needed / 1000:.1f} KB" in str(refused.value) and "1.0 KB free" in str(
        refused.value) and "HF_HUB_CACHE" in str(refused.value)
    assert not weight_gets(hub)


def test_a_local_folder_of_that_name_is_the_folder_and_names_keep_their_meaning(hub, models, cache, monkeypatch):
    monkeypatch.chdir(models.llama.parent.parent)
    shutil.copytree(models.llama, models.llama.parent.parent / REPO, dirs_exist_ok=True)
    assert resolve_model(REPO, cache).resolve() == (models.llama.parent.parent / REPO).resolve()
    assert not hub.requests
    with pytest.raises(UnknownModelError, match="only a model named by its Hugging Face Hub id"):
        resolve_model(REPO, cache, "v2")
    with pytest.raises(UnknownModelError, match="give a known name"):
        resolve_model("no-such-model", cache)
    assert not hub.requests


def test_a_server_and_a_gateway_refuse_to_start_with_the_line(hub, tmp_path):
    env = local_hub.environment(hub.url, tmp_path / "hub")
    server = run_tool("-m", "swarm.server", "--model", GATED, "--blocks", "0:2", "--initial-peers", BOGUS_PEER, env=env)
    assert server.returncode == 1 and server.stderr.strip().splitlines()[-1].startswith(f"error: {GATED} is a gated model")
    assert "HF_TOKEN" in server.stderr and "Traceback" not in server.stderr
    gateway = run_tool("app.py", "--model", REPO, "--revision", "v9", "--initial-peers", BOGUS_PEER, "--port",
                       str(free_port()), env={**env, "SESSION_STORE": "off"})  # gunicorn's master says it, no worker
    assert gateway.returncode == 1 and "Traceback" not in gateway.stderr and "Booting worker" not in gateway.stderr
    assert gateway.stderr.strip().splitlines()[-1] == (f"error: {REPO} has no revision 'v9': give --revision a branch, "
                                                       "tag or commit of it (default: main)")


def span_folder(cache):
    return next((cache / "models--tiny-org--tiny-llama" / "snapshots").iterdir())


def one_line(refused) -> bool:
    return "\n" not in str(refused.value)
