"""Loading and letting go of models (MAX_LOADED_MODELS): a model let go keeps its engine loop while a session on it
runs, and the loop's thread ends with its sessions' work; the engine then holds the model no longer."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from config import GatewaySettings, Limits, ModelConfig, Settings, SwarmSettings
from gateway.engine.generation import Engine
from gateway.engine.loop import LET_GO_CHECK_SECONDS
from gateway.engine.sampler import Sampler
from gateway.engine.sampling import SamplingParams
from gateway.engine.sequences import Sequence
from local_remote import LocalRemote

BOUND = 30.0  # seconds: a hang detector, not a timing (the loop looks every LET_GO_CHECK_SECONDS)


@pytest.fixture(scope="module")
def remote(tiny_llama):
    return LocalRemote(tiny_llama)


@pytest.fixture
def engine(tiny_llama, remote, tmp_path):
    models = tuple(ModelConfig(name, str(tiny_llama), max_session_length=64) for name in ("first", "second"))
    gateway = GatewaySettings(models=models, limits=Limits(max_loaded_models=1, speculative_tokens=0))
    return Engine(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway), connect=lambda config: remote)


def loop_threads(model_name: str) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == f"engine-loop-{model_name}"]


def reply(engine: Engine, session) -> None:
    """A few tokens generated on the session, through its model's engine loop."""
    model = session.model
    sequence = Sequence(session, model.encode("a prompt", at_start=not session.history), 3,
                        Sampler(SamplingParams(), model.vocab_size), None, set(), None)
    engine.loop_of(model).submit(sequence)
    assert sequence.settled.wait(BOUND) and sequence.stream.error is None, sequence.stream.error


def wait_until(condition) -> bool:
    deadline = time.monotonic() + BOUND
    while not condition() and time.monotonic() < deadline:
        time.sleep(LET_GO_CHECK_SECONDS / 4)
    return condition()


def test_a_model_let_go_ends_its_loop_thread_once_its_sessions_are_done(engine):
    session = engine.open_session("first", 64, expires=False)
    reply(engine, session)
    assert len(loop_threads("first")) == 1
    engine.model("second")  # MAX_LOADED_MODELS=1: "first" is let go
    assert [model.name for model in engine.loaded_models()] == ["second"]
    reply(engine, session)  # a session open on it still runs
    assert wait_until(lambda: not loop_threads("first"))  # then its loop's thread ends
    first = weakref.ref(session.model)
    engine.close_session(session)
    del session
    gc.collect()
    assert first() is None  # nothing holds the model let go: its weights are freed


def test_a_late_request_on_a_model_let_go_starts_its_loop_again(engine):
    session = engine.open_session("first", 64, expires=False)
    engine.model("second")
    reply(engine, session)
    assert wait_until(lambda: not loop_threads("first"))
    reply(engine, session)  # the ended loop serves it: its thread starts again, and ends again
    assert wait_until(lambda: not loop_threads("first"))
    assert len(loop_threads("second")) == 0  # a model never generated on has no loop
    engine.close_session(session)
