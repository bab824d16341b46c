"""A model's context: its own (max_position_embeddings) unless configured lower, bounded by the swarm's servers."""

from types import SimpleNamespace

from config import ModelConfig
from gateway.engine import served as served_module
from gateway.engine.served import UNKNOWN_CONTEXT, ServedModel


class FakeSwarm:
    """What ServedModel asks of the swarm client: the longest session its servers hold (counted)."""

    def __init__(self, longest):
        self.longest, self.asked = longest, 0

    def longest_session(self, prefix, num_blocks):
        self.asked += 1
        if isinstance(self.longest, Exception):
            raise self.longest
        return self.longest


def served(max_session_length=None, trained=8192, longest=None) -> tuple[ServedModel, FakeSwarm]:
    swarm = FakeSwarm(longest)
    config = SimpleNamespace(vocab_size=10) if trained is None else SimpleNamespace(vocab_size=10, max_position_embeddings=trained)
    remote = SimpleNamespace(tokenizer=None, stop_token_ids=(), config=config, client=swarm, prefix="m", num_blocks=4)
    return ServedModel(ModelConfig(name="m", path="m", max_session_length=max_session_length), remote), swarm


def test_the_default_is_what_the_model_was_trained_for_when_the_swarm_holds_it():
    model, _ = served(longest=32768)
    assert model.max_session_length == 8192 and model.config.max_session_length == 8192


def test_the_swarm_bounds_it_and_the_setting_overrides_both():
    assert served(longest=4096)[0].max_session_length == 4096
    assert served(max_session_length=1024, longest=4096)[0].max_session_length == 1024
    assert served(max_session_length=1024, longest=4096)[0].config.max_session_length == 1024


def test_an_unknown_swarm_leaves_the_models_own_and_a_model_without_one_gets_a_default():
    assert served(longest=None)[0].max_session_length == 8192
    assert served(longest=RuntimeError("no DHT"))[0].max_session_length == 8192
    assert served(trained=None, longest=None)[0].max_session_length == UNKNOWN_CONTEXT


def test_the_swarm_is_asked_at_most_once_per_catalogue_period(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(served_module.time, "monotonic", lambda: now[0])
    model, swarm = served(longest=4096)
    for _ in range(5):
        assert model.max_session_length == 4096
    assert swarm.asked == 1
    swarm.longest = 2048  # a server with a smaller cache took over
    now[0] += served_module.CATALOGUE_SECONDS
    assert model.max_session_length == 2048 and swarm.asked == 2
