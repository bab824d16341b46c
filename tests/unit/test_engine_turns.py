"""turns.py's choices on their own (the loop's side is tests/unit/test_engine_sharing.py): room is never exceeded,
the client with the fewest steps in flight goes next, its oldest session first, and an ended sequence never steps."""

from dataclasses import dataclass, field
from itertools import count

from gateway.engine.speculation import StepCosts
from gateway.engine.turns import Sharing, Turns

_ids = count()


@dataclass(eq=False)
class Session:
    owner: str
    id: str = field(default_factory=lambda: f"session-{next(_ids)}")


@dataclass(eq=False)
class Reply:
    session: Session


def replies(owner: str, number: int) -> list[Reply]:
    return [Reply(Session(owner)) for _ in range(number)]


def test_without_a_bound_every_waiting_sequence_steps_at_once():
    turns = Turns(Sharing(0))
    batch = replies("key:a", 5) + replies("key:b", 1)
    turns.add(batch)
    assert sorted(map(id, turns.take())) == sorted(map(id, batch)) and len(turns) == 0


def test_room_goes_to_the_client_with_the_fewest_steps_in_flight_its_oldest_first():
    turns = Turns(Sharing(3))
    many, one = replies("key:many", 4), replies("key:one", 1)
    turns.add(many + one)
    first = turns.take()
    assert first == [many[0], one[0], many[1]] and len(turns) == 2  # alternately, then the rest to who can use it
    turns.flew(first)
    assert turns.take() == []  # no room until a step lands
    turns.landed(one[0])
    turns.add([one[0]])
    assert turns.take() == [one[0]]  # key:one has fewer in flight than key:many's two
    turns.flew([one[0]])
    turns.landed(many[0])
    assert turns.take() == [many[2]]  # only key:many waits


def test_per_session_sharing_takes_sessions_in_turn():
    turns = Turns(Sharing(2, "session"))
    many, one = replies("key:many", 3), replies("key:one", 1)
    turns.add(many + one)
    assert turns.take() == many[:2]  # every session has nothing in flight: the oldest go first


def test_a_sequence_that_ended_while_waiting_never_steps():
    turns = Turns(Sharing(1))
    batch = replies("key:a", 2)
    turns.add(batch)
    turns.discard(batch[0])
    turns.discard(batch[0])  # twice is harmless
    assert turns.take() == [batch[1]] and len(turns) == 0


def costs_of(line) -> StepCosts:
    """Round trips by steps in flight that follow `line` (base, per step) exactly."""
    costs = StepCosts(guess=False)
    base, per_step = line
    for in_flight in (1, 4, 16, 64) * 4:
        costs.observed(in_flight, base + per_step * in_flight)
    return costs


def test_without_enough_round_trips_or_where_a_step_more_costs_nothing_no_bound_is_found():
    from gateway.engine.turns import found_bound

    same_size = StepCosts(guess=False)
    for _ in range(10):
        same_size.observed(17, 0.2)
    assert found_bound(StepCosts(guess=False)) is None and found_bound(same_size) is None  # no line yet
    assert found_bound(costs_of((0.004, 0.0))) is None  # a GPU's rounds, a tiny model's: everyone steps each tick


def test_a_found_bound_keeps_nine_tenths_of_the_most_tokens_a_second():
    """Compute-bound rounds (10 ms a step, 3 ms more for each step beside it): 30 steps in flight carry 30 / 100 ms,
    90% of the 1 / 3 ms the loop tends to, where 64 of them would make everyone's step 2x slower for 7% more."""
    from gateway.engine.turns import FEWEST_FOUND, found_bound

    bound = found_bound(costs_of((0.010, 0.003)))
    assert bound == 30 and (bound / (0.010 + 0.003 * bound)) >= 0.9 / 0.003 - 1e-6
    assert found_bound(costs_of((0.010, 0.1))) == FEWEST_FOUND  # never fewer than a few together


def test_the_loop_finds_its_bound_from_the_steps_it_sends(monkeypatch):
    """Without ENGINE_MAX_STEPS, the steps' own round trips (flew, landed) set the bound that take() keeps to."""
    from gateway.engine import turns as turns_module

    now = [0.0]
    monkeypatch.setattr(turns_module.time, "perf_counter", lambda: now[0])
    turns = Turns(Sharing(0))
    for in_flight in (1, 10, 20, 1, 10, 20):  # each step's round trip: 10 ms, and 3 ms for each step in flight
        batch = replies("key:a", in_flight)
        turns.add(batch)
        now[0] = 0.0
        turns.flew(turns.take())
        now[0] = 0.010 + 0.003 * in_flight
        for reply in batch:
            turns.landed(reply)
    assert turns.bound() == 30 and len(turns) == 0
    turns.add(replies("key:a", 200))
    assert len(turns.take()) == 30 and len(turns) == 170
