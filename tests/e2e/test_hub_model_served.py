"""A model named by its Hugging Face Hub id, served end to end: block servers and a gunicorn gateway started with
`--model ORG/NAME` (MODEL) fetch from a local Hub (tests/local_hub.py), each into a cache of its own as on machines
of their own, only the weight files that hold what they load; the gateway finds the servers under the DHT prefix
both derive from the id, and its greedy reply equals the local model's. What the fetching does in detail (a
second start, a cut download, offline, gated, the refusals): tests/integration/test_hub_models.py."""

from __future__ import annotations

import json

import openai
import pytest

import local_hub
from exact_match import assert_chat_reply_is_the_local_greedy_token
from gunicorn_gateway import running_gateway
from local_hub import LocalHub
from tiny_model import build_tiny_model

REPO = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def hub_model(tmp_path_factory):
    """8 Llama blocks in 8 weight files (a file holds one or two blocks' tensors), served by a local Hub."""
    folder = build_tiny_model(tmp_path_factory.mktemp("hub-llama"), "llama", 8, max_shard_size="200KB")
    hub = LocalHub().start()
    hub.add(REPO, folder)
    yield hub, folder
    hub.stop()


def fetched_weights(hub, origin: str) -> set[str]:
    return {name for name in hub.file_gets(REPO, origin) if name.endswith(".safetensors")}


def files_of(folder, *prefixes) -> set[str]:
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    return {file for name, file in weight_map.items() if name.startswith(prefixes)}


def test_servers_and_a_gateway_fetch_only_their_files_and_answer_as_the_local_model(hub_model, tmp_path):
    """Two servers (blocks 6:8 and 0:6) and the gateway start at once, each told apart at the Hub by its origin."""
    from swarm.local import LocalSwarm

    hub, folder = hub_model
    layers = [f"model.layers.{index}." for index in range(8)]
    with LocalSwarm(REPO, [], log_dir=tmp_path) as swarm:
        servers = []
        for name, blocks in (("server-a", "6:8"), ("server-b", "0:6")):
            swarm.env.update(local_hub.environment(hub.url, tmp_path / name, origin=name))  # a cache of its own
            servers.append(swarm.add_server(["--blocks", blocks], wait=False))
        env = {"INITIAL_PEERS": " ".join(swarm.initial_peers), "MODEL": REPO,
               **local_hub.environment(hub.url, tmp_path / "gateway", origin="gateway")}
        with running_gateway(env, tmp_path) as gateway:
            for server in servers:
                server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), 180)
            assert fetched_weights(hub, "server-a") == files_of(folder, *layers[6:]) == {
                "model-00006-of-00008.safetensors", "model-00007-of-00008.safetensors"}
            assert fetched_weights(hub, "server-b") == files_of(folder, *layers[:6]) and len(
                fetched_weights(hub, "server-b")) == 6
            assert fetched_weights(hub, "gateway") == files_of(folder, "model.embed_tokens.", "model.norm.",
                                                               "lm_head.") == {
                "model-00001-of-00008.safetensors", "model-00007-of-00008.safetensors",
                "model-00008-of-00008.safetensors"}
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            assert [model.id for model in client.models.list().data] == ["tiny-llama"]
            messages = [{"role": "user", "content": "What is a swarm?"}]
            reply = client.chat.completions.create(model="tiny-llama", temperature=0, max_tokens=1, messages=messages)
            assert_chat_reply_is_the_local_greedy_token(reply, folder, "tiny-llama", messages, None)
