"""Several models in one swarm, discovered from what the servers announce, served by one gateway."""

import json

import openai
import pytest
import requests

from gunicorn_gateway import running_gateway
from processes import run_tool
from swarm.local import LocalSwarm
from tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def two_model_swarm(tiny_llama, tmp_path_factory):
    second = build_tiny_model(tmp_path_factory.mktemp("second") / "tiny-second", "llama", num_layers=3, seed=1)
    with LocalSwarm(str(tiny_llama), [(0, 2), (2, 4)], server_args=["--dht-prefix", "first"],
                    log_dir=tmp_path_factory.mktemp("catalogue-logs")) as swarm:
        swarm.add_server(["--model", str(second), "--blocks", "0:3", "--dht-prefix", "tiny-second"])
        yield swarm, second


@pytest.fixture(scope="module")
def one_gateway(two_model_swarm, tiny_llama, tmp_path_factory):
    swarm, _ = two_model_swarm
    configured = [{"name": "first", "path": str(tiny_llama), "dht_prefix": "first", "max_session_length": 256}]
    with running_gateway({"INITIAL_PEERS": " ".join(swarm.initial_peers), "MODELS": json.dumps(configured)},
                         tmp_path_factory.mktemp("catalogue-gateway")) as server:
        yield server


def test_catalogue_command_lists_what_servers_announce(two_model_swarm):
    swarm, second = two_model_swarm
    result = run_tool("-m", "swarm.client.catalogue", "--initial-peers", *swarm.initial_peers)
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:]}
    assert lines["tiny-second"][1:5] == ["tiny-second", "3", "1", "complete"]
    assert lines["tiny-llama0"][1:5] == ["first", "4", "2", "complete"]


def test_gateway_serves_a_model_it_was_not_configured_with(one_gateway):
    client = openai.OpenAI(base_url=one_gateway.url + "/v1", api_key="unused", max_retries=0)
    assert sorted(model.id for model in client.models.list().data) == ["first", "tiny-second"]
    listed = requests.get(one_gateway.url + "/api/v1/models").json()["models"]
    assert {(model["name"], model["source"], model["num_blocks"]) for model in listed} == {
        ("first", "config", 4), ("tiny-second", "swarm", 3)}
    for name in ("first", "tiny-second"):
        reply = client.completions.create(model=name, prompt="Hello", max_tokens=3, temperature=0)
        assert reply.model == name and reply.usage.completion_tokens == 3
