"""turns.py's choices on their own (the loop's side is tests/unit/test_engine_sharing.py): room is never exceeded,
the client with the fewest steps in flight goes next, its oldest session first, and an ended sequence never steps."""

from dataclasses import dataclass, field
from itertools import count

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
