"""Several models in one swarm, discovered from what the servers announce, served by one gateway as its operator
says (DISCOVERED_MODELS=cached: those in its own model cache), and never from a path a stranger's record names."""

import json

import openai
import pytest
import requests

from gunicorn_gateway import running_gateway
from processes import run_tool
from swarm.local import LocalSwarm
from tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def gateway_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("gateway-cache")


@pytest.fixture(scope="module")
def three_model_swarm(tiny_llama, gateway_cache, tmp_path_factory):
    """The configured model ("first"), a model the gateway has in its cache ("tiny-cached"), and a stranger's
    ("tiny-second"): its record names a folder on this machine (where its server runs), outside that cache."""
    cached = build_tiny_model(gateway_cache / "models" / "tiny-cached", "llama", num_layers=3, seed=2)
    stranger = build_tiny_model(tmp_path_factory.mktemp("second") / "tiny-second", "llama", num_layers=3, seed=1)
    with LocalSwarm(str(tiny_llama), [(0, 4)], server_args=["--dht-prefix", "first"],
                    log_dir=tmp_path_factory.mktemp("catalogue-logs")) as swarm:
        for folder in (cached, stranger):
            swarm.add_server(["--model", str(folder), "--blocks", "0:3", "--dht-prefix", folder.name], wait=False)
        for server in swarm.servers[1:]:
            server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), 120)
        yield swarm


@pytest.fixture(scope="module")
def one_gateway(three_model_swarm, tiny_llama, gateway_cache, tmp_path_factory):
    configured = [{"name": "first", "path": str(tiny_llama), "dht_prefix": "first", "max_session_length": 256}]
    env = {"INITIAL_PEERS": " ".join(three_model_swarm.initial_peers), "MODELS": json.dumps(configured),
           "SWARM_CACHE_DIR": str(gateway_cache), "DISCOVERED_MODELS": "cached"}
    with running_gateway(env, tmp_path_factory.mktemp("catalogue-gateway")) as server:
        yield server


def test_catalogue_command_lists_what_servers_announce(three_model_swarm):
    result = run_tool("-m", "swarm.client.catalogue", "--initial-peers", *three_model_swarm.initial_peers)
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:]}
    assert lines["tiny-second"][1:5] == ["tiny-second", "3", "1", "complete"]
    assert lines["tiny-cached"][1:5] == ["tiny-cached", "3", "1", "complete"]
    assert lines["tiny-llama0"][1:5] == ["first", "4", "1", "complete"]


def test_gateway_serves_a_model_of_its_cache_it_was_not_configured_with(one_gateway):
    client = openai.OpenAI(base_url=one_gateway.url + "/v1", api_key="unused", max_retries=0)
    assert sorted(model.id for model in client.models.list().data) == ["first", "tiny-cached"]
    listed = requests.get(one_gateway.url + "/api/v1/models").json()["models"]
    assert {(model["name"], model["source"], model["num_blocks"]) for model in listed} == {
        ("first", "config", 4), ("tiny-cached", "swarm", 3)}
    for name in ("first", "tiny-cached"):
        reply = client.completions.create(model=name, prompt="Hello", max_tokens=3, temperature=0)
        assert reply.model == name and reply.usage.completion_tokens == 3


def test_a_record_naming_a_folder_is_neither_loaded_nor_served(one_gateway):
    """The stranger's model is announced (the catalogue command lists it) and its blocks are served, but its
    files are where its record says, not in the gateway's cache."""
    client = openai.OpenAI(base_url=one_gateway.url + "/v1", api_key="unused", max_retries=0)
    requests.get(one_gateway.url + "/api/v1/models").raise_for_status()  # what the chat page asks on load
    with pytest.raises(openai.NotFoundError, match="unknown model 'tiny-second'"):
        client.completions.create(model="tiny-second", prompt="Hello", max_tokens=3)
    loaded = {model["name"] for model in requests.get(one_gateway.url + "/api/ps").json()["models"]}
    assert not any("second" in name for name in loaded)
