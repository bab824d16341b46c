"""The gateway's served models (gateway/engine/catalogue.py): what a stranger's catalogue record can make it serve
and load, listing without loading, the bound on loaded models, and one model loading while others serve."""

import json
import threading
from types import SimpleNamespace

import pytest

from config import GatewaySettings, Limits, ModelConfig, Settings, SwarmSettings
from gateway.engine.catalogue import ServedModels
from gateway.engine.generation import Engine
from gateway.errors import NotFound
from swarm.protocol import ModelRecord


class FakeSwarm:
    """The SwarmClient's lookups: a fixed catalogue, every model covered."""

    def __init__(self, records):
        self.records, self.catalogue_reads = records, 0

    def catalogue(self):
        self.catalogue_reads += 1
        return self.records

    def coverage(self, prefix, num_blocks, adapter=None):
        return SimpleNamespace(num_blocks=num_blocks, servers=1, covered=True, missing_blocks=None)

    def adapter_coverage(self, prefix, num_blocks):
        return {}

    def longest_session(self, prefix, num_blocks):
        return 1024


class Loads:
    """`connect`: records which models were loaded; a model named in `blocked` waits for its event."""

    def __init__(self, blocked=None):
        self.names, self.blocked, self.started = [], blocked or {}, threading.Event()

    def __call__(self, config: ModelConfig):
        self.names.append(config.name)
        if config.name in self.blocked:
            self.started.set()
            assert self.blocked[config.name].wait(30)
        model_config = SimpleNamespace(num_hidden_layers=2, max_position_embeddings=4096, vocab_size=10)
        return SimpleNamespace(config=model_config, prefix=config.dht_prefix or config.name, num_blocks=2,
                               tokenizer=None, stop_token_ids=frozenset())


def cached_model(cache_dir, name, blocks=3):
    folder = cache_dir / "models" / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": blocks,
                                                    "max_position_embeddings": 512}))
    return folder


def served(tmp_path, records=(), discovered="cached", configured=("first",), loads=None, **limits):
    models = tuple(ModelConfig(name, name, dht_prefix=name) for name in configured)
    gateway = GatewaySettings(models=models, limits=Limits(**limits), discovered_models=discovered)
    settings = Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway)
    swarm = FakeSwarm(list(records))
    return ServedModels(settings, loads or Loads(), lambda: swarm), swarm


def record(name, prefix=None, blocks=3, source=None):
    return ModelRecord(name, prefix or name, blocks, source or name)


def test_by_default_only_the_configured_models_are_served_and_the_catalogue_is_not_read(tmp_path):
    cached_model(tmp_path, "cached-one")
    models, swarm = served(tmp_path, [record("cached-one")], discovered="none")
    assert models.discovered() == [] and swarm.catalogue_reads == 0
    with pytest.raises(NotFound, match="served models: first$"):
        models.config("cached-one")


def test_a_record_never_names_a_path_only_a_model_of_the_cache(tmp_path):
    elsewhere = cached_model(tmp_path / "elsewhere", "stolen")  # a folder with a config.json, outside the cache
    cached_model(tmp_path, "cached-one")
    records = [record("stolen", source=str(elsewhere)), record(str(elsewhere), prefix="by-path"),
               record("../elsewhere/models/stolen", prefix="up"), record("cached-one", source=str(elsewhere))]
    models, _ = served(tmp_path, records)
    assert [config.name for config in models.discovered_configs()] == ["cached-one"]
    assert models.config("cached-one").path == str(tmp_path / "models" / "cached-one")  # never the record's source
    for name in ("stolen", str(elsewhere), "../elsewhere/models/stolen"):
        with pytest.raises(NotFound):
            models.get(name)


def test_discovered_models_named_by_the_operator_are_the_only_ones_served(tmp_path):
    for name in ("cached-one", "cached-two"):
        cached_model(tmp_path, name)
    models, _ = served(tmp_path, [record("cached-one"), record("cached-two")], discovered="cached-two")
    assert [config.name for config in models.discovered_configs()] == ["cached-two"]


def test_a_record_that_disagrees_with_the_cached_model_or_is_ambiguous_is_not_served(tmp_path):
    cached_model(tmp_path, "other-shape", blocks=3)
    cached_model(tmp_path, "twice")
    records = [record("other-shape", blocks=30), record("twice", prefix="twice-a"), record("twice", prefix="twice-b"),
               record("first", prefix="first-again")]  # a configured model's name under another prefix
    models, _ = served(tmp_path, records)
    assert models.discovered_configs() == []


def test_listing_loads_no_discovered_model(tmp_path):
    cached_model(tmp_path, "cached-one")
    loads = Loads()
    models, _ = served(tmp_path, [record("cached-one", prefix="one")], loads=loads)
    listed = {entry["name"]: entry for entry in models.listed()}
    assert listed["cached-one"] == {"name": "cached-one", "source": "swarm", "num_blocks": 3, "servers": 1,
                                    "covered": True, "missing_blocks": None, "max_session_length": 512}
    assert loads.names == ["first"]  # the configured model (whose shape only its load tells), not the discovered
    models.listed()
    assert loads.names == ["first"]


def engine_of(tmp_path, configured, loads, **limits):
    """An engine as the gateway has it, loading models through `loads`."""
    models = tuple(ModelConfig(name, name, dht_prefix=name) for name in configured)
    settings = Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=GatewaySettings(models, Limits(**limits)))
    return Engine(settings, connect=loads)


def test_at_most_max_loaded_models_stay_loaded_least_recently_used_first(tmp_path):
    loads = Loads()
    engine = engine_of(tmp_path, ("a", "b", "c"), loads, max_loaded_models=2)
    for name in ("a", "b", "a", "c"):
        engine.model(name)
    assert [model.name for model in engine.loaded_models()] == ["a", "c"]
    engine.model("b")  # let go: loaded again
    assert loads.names == ["a", "b", "c", "b"] and [model.name for model in engine.loaded_models()] == ["c", "b"]
    assert engine.models.shape("a").num_blocks == 2  # a model let go is still listed from its load, not loaded again
    assert loads.names == ["a", "b", "c", "b"]


def test_a_model_loading_holds_up_no_request_for_another(tmp_path):
    release = threading.Event()
    loads = Loads(blocked={"slow": release})
    engine = engine_of(tmp_path, ("slow", "fast"), loads)
    slow = [threading.Thread(target=engine.model, args=("slow",)) for _ in range(2)]
    for thread in slow:
        thread.start()
    try:
        assert loads.started.wait(30)
        fast = threading.Thread(target=engine.model, args=("fast",), daemon=True)
        fast.start()
        fast.join(30)  # a bound, not a timing: with one lock for all models it never ends while "slow" loads
        assert not fast.is_alive() and [model.name for model in engine.loaded_models()] == ["fast"]
    finally:
        release.set()
        for thread in slow:
            thread.join(30)
    assert {model.name for model in engine.loaded_models()} == {"slow", "fast"}
    assert loads.names.count("slow") == 1  # the second request for it waited for the first's load


@pytest.mark.parametrize("environ, message", [
    ({"DISCOVERED_MODELS": "/home/me/model"}, "DISCOVERED_MODELS must be none, cached or a list of model names"),
    ({"DISCOVERED_MODELS": "a,../b"}, "DISCOVERED_MODELS"),
    ({"MAX_LOADED_MODELS": "0"}, "MAX_LOADED_MODELS must be at least 1"),
])
def test_bad_settings_are_refused_naming_them(environ, message):
    with pytest.raises(ValueError, match=message):
        GatewaySettings.from_env(environ)


def test_settings_read_from_the_environment():
    settings = GatewaySettings.from_env({"DISCOVERED_MODELS": "one, two", "MAX_LOADED_MODELS": "3"})
    assert settings.serves_discovered("two") and not settings.serves_discovered("three")
    assert settings.limits.max_loaded_models == 3
    assert GatewaySettings.from_env({}).discovered_models == "none"
