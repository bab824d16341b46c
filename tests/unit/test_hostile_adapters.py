"""One record naming hundreds of LoRA adapters (any peer may write one): the gateway's model listing stays a few
DHT lookups and a bounded list, and every "model:adapter" shares its model's draft model. The real SwarmClient
and ServedModels, over a fake DHT that counts lookups."""

from types import SimpleNamespace

import pytest

from config import GatewaySettings, ModelConfig, Settings, SwarmSettings
from gateway.engine.catalogue import ServedModels
from gateway.engine.drafts import DraftModels
from swarm import dht
from swarm.client.peers import Bans, DeadPeers, PeerLoad
from swarm.client.routing import MAX_ADAPTERS_PER_MODEL
from swarm.client.swarm_client import SwarmClient
from swarm.protocol import MAX_ADAPTERS, RemoteServer, ServerInfo, ServerState

BLOCKS = 4
FAKES = [f"fake-{index:03}" for index in range(MAX_ADAPTERS)]  # as many as a record may name


def server(peer, adapters):
    return RemoteServer(peer, ServerInfo(ServerState.ONLINE, 0, BLOCKS, 100.0, 1024, max_session_tokens=512,
                                         adapters=tuple(adapters)))


@pytest.fixture
def lookups(monkeypatch):
    """The DHT: an honest server with one adapter, and a peer whose record names as many as a record may; each lookup counted."""
    asked = []

    async def fetch_servers(node, prefix, num_blocks, allowed=()):
        asked.append(prefix)
        return [server("honest", ["real"]), server("hostile", FAKES)]

    monkeypatch.setattr(dht, "fetch_servers", fetch_servers)
    return asked


def swarm_client():
    client = SwarmClient.__new__(SwarmClient)  # its lookups only: no node, no network, no probes
    client.loop, client.node, client.allowed_servers = dht.EventLoop.get(), None, frozenset()
    client.bans, client.load, client._starts, client.region = Bans(), PeerLoad(), {}, None
    client.dead, client._told_incompatible = DeadPeers(), set()
    client.probes = SimpleNamespace(consider=lambda peers: None)
    return client


def served_models(client, cache_dir):
    model = ModelConfig("first", "first", dht_prefix="first", draft_model="a-draft-model")
    settings = Settings(swarm=SwarmSettings(cache_dir=cache_dir), gateway=GatewaySettings(models=(model,)))

    def connect(config):
        remote = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=BLOCKS, max_position_embeddings=4096),
                                 prefix="first", num_blocks=BLOCKS, tokenizer="its tokenizer",
                                 stop_token_ids=frozenset(), client=client)
        remote.with_adapter = lambda adapter: SimpleNamespace(**{**vars(remote), "adapter": adapter})
        return remote

    return ServedModels(settings, connect, lambda: client)


def test_a_record_of_hundreds_of_adapters_costs_a_listing_one_lookup_and_lists_a_bounded_few(lookups, tmp_path):
    models = served_models(swarm_client(), tmp_path)
    listed = models.listed()
    # the model's coverage, its longest session, and all its adapters' coverage: one lookup each
    assert len(lookups) <= 3
    adapters = [entry["name"] for entry in listed if "parent" in entry]
    assert len(adapters) == MAX_ADAPTERS_PER_MODEL and "first:real" in adapters  # not crowded out by the fakes
    assert all(entry["covered"] and entry["servers"] == 1 for entry in listed if "parent" in entry)
    lookups.clear()
    models.listed()
    assert len(lookups) == 1  # within a few seconds, only the model's own coverage is asked again


def test_every_adapter_of_a_model_shares_its_one_draft_model(lookups, tmp_path, monkeypatch):
    models, drafts, loads = served_models(swarm_client(), tmp_path), DraftModels(tmp_path), []
    monkeypatch.setattr(drafts, "_load", lambda name, served: loads.append(served.name) or object())
    draft = drafts.of(models.get("first"))
    assert all(drafts.of(models.get(f"first:{adapter}")) is draft for adapter in ["real", *FAKES[:5]])
    assert loads == ["first"]


def test_a_server_announces_at_most_as_many_adapters_as_a_record_may_name(capsys, tmp_path):
    """A record names no more adapters than a client keeps per model: a server refuses more at start, naming the
    flag, rather than announce a record every client would drop."""
    from swarm.server.settings import parse_settings

    peer = ["--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"]
    folders = [str(tmp_path / f"adapter-{index}") for index in range(MAX_ADAPTERS + 1)]
    with pytest.raises(SystemExit):
        parse_settings(["--blocks", "0:1", *peer, "--adapters", *folders])
    assert f"--adapters: at most {MAX_ADAPTERS} adapters per server, got {MAX_ADAPTERS + 1}" in capsys.readouterr().err
    assert MAX_ADAPTERS <= MAX_ADAPTERS_PER_MODEL
