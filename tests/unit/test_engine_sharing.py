"""The engine loop shared between clients once it is saturated (issue 39, item 9): past ENGINE_MAX_STEPS steps in
flight the ready sessions take turns, and each client gets an equal part of the steps (its sessions share that part),
or each session does with ENGINE_SHARING=session. Shares are counted in steps over a fixed number of ticks."""

import pytest

from config import GatewaySettings, Limits, ModelConfig, Settings, SwarmSettings
from gateway.engine.generation import Engine
from gateway.engine.loop import EngineLoop
from gateway.engine.sampler import Sampler
from gateway.engine.sampling import SamplingParams
from gateway.engine.sequences import Sequence
from gateway.engine.turns import Sharing
from local_remote import LocalRemote

TOKENS, TICKS = 14, 12  # every session still has tokens to make after TICKS ticks
MANY, MAX_STEPS = 4, 2  # the sessions of the client with many; steps in flight at once


class CountedSteps(LocalRemote):
    """Records whose steps each start_steps call carried (one call per tick)."""

    def __init__(self, folder):
        super().__init__(folder)
        self.ticks: list[list[str]] = []

    def start_steps(self, steps, on_done):
        self.ticks.append([sequence.session.owner for sequence, *_ in steps])
        super().start_steps(steps, on_done)


@pytest.fixture(scope="module")
def remote(tiny_llama):
    return CountedSteps(tiny_llama)


@pytest.fixture
def engine(tiny_llama, remote, tmp_path):
    limits = Limits(max_sessions=16, max_sessions_per_client=16, speculative_tokens=0)
    gateway = GatewaySettings(models=(ModelConfig("tiny", str(tiny_llama), max_session_length=64),), limits=limits)
    return Engine(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway), connect=lambda config: remote)


def replies(engine, owners: list[str]) -> list[Sequence]:
    model = engine.model("tiny")
    made = []
    for index, owner in enumerate(owners):
        session = engine.open_session("tiny", 64, expires=False, owner=owner)
        feed = model.encode(f"prompt number {index}", at_start=True)
        made.append(Sequence(session, feed, TOKENS, Sampler(SamplingParams(), model.vocab_size), None, set(), None))
    return made


def steps_per_client(engine, remote, sharing: Sharing) -> dict[str, int]:
    """Steps each client got in the first TICKS ticks of a saturated loop: MANY sessions of key:many, one of
    key:one, all submitted at once; every reply runs to its end."""
    batch = replies(engine, ["key:many"] * MANY + ["key:one"])
    loop = EngineLoop(engine.model("tiny"), 0, sharing=sharing)
    remote.ticks.clear()
    loop.submit(*batch)
    for sequence in batch:
        assert sequence.settled.wait(60) and sequence.stream.error is None, sequence.stream.error
        assert len(sequence.generated) == TOKENS
    assert all(len(tick) <= (sharing.max_steps or len(batch)) for tick in remote.ticks)
    counted = [owner for tick in remote.ticks[:TICKS] for owner in tick]
    return {owner: counted.count(owner) for owner in ("key:many", "key:one")}


def test_a_saturated_loop_gives_each_client_an_equal_part(engine, remote):
    shares = steps_per_client(engine, remote, Sharing(MAX_STEPS, "client"))
    assert shares == {"key:many": TICKS, "key:one": TICKS}  # a step each per tick: many's four take turns


def test_per_session_sharing_gives_each_session_an_equal_part(engine, remote):
    shares = steps_per_client(engine, remote, Sharing(MAX_STEPS, "session"))
    assert shares["key:many"] + shares["key:one"] == MAX_STEPS * TICKS
    assert abs(shares["key:many"] - MANY * shares["key:one"]) <= MANY  # four sessions' parts to one's


def test_a_loop_with_room_steps_every_session_each_tick(engine, remote):
    shares = steps_per_client(engine, remote, Sharing(0))
    assert shares == {"key:many": MANY * TICKS, "key:one": TICKS}


def test_the_engine_loop_takes_its_sharing_from_the_limits(engine):
    loop = engine.loop_of(engine.model("tiny"))
    assert loop.turns.sharing == Sharing(Limits.engine_max_steps, "client")
