"""bench.lora on the tiny model: its random adapters are folders a server reads, and every mix of a round is timed
(the figures themselves come from `python -m bench.lora`)."""

from argparse import Namespace

from bench.lora import ADAPTERS, measure, mixes, write_adapter
from swarm.server.adapters import read_adapter
from swarm.server.span import load_span
from tiny_model import build_tiny_model


def test_mixes_put_sessions_through_the_adapters_as_named():
    rounds = mixes(8)
    assert rounds["no adapter"] == [None] * 8 and set(rounds["one adapter"]) == {ADAPTERS[0]}
    assert set(rounds["four adapters"]) == set(ADAPTERS) and rounds["half one adapter, half none"].count(None) == 4


def test_the_benchmark_adapters_load_and_every_mix_is_timed(tmp_path):
    folder = build_tiny_model(tmp_path / "tiny", "llama", 2)
    adapter = read_adapter(write_adapter(load_span(folder, 0, 2), tmp_path / "lora-x", rank=2, seed=0))
    assert adapter.name == "lora-x" and len(adapter.tensors) == 2 * 4 * 2  # blocks x targets x (A, B)
    milliseconds = measure(folder, Namespace(device="cpu", dtype="float32", rank=2, sessions=4, repeats=1))
    assert set(milliseconds) == set(mixes(4)) and all(value > 0 for value in milliseconds.values())
