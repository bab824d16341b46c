"""The fields of a client's metadata that a server reads as integers: checked, or refused naming the field."""

from __future__ import annotations

from swarm.protocol import BadRequestError


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # msgpack's true is a Python int too


def declared_positions(metadata: dict, max_length: int) -> int:
    """What a client's opening or step declares its next step may carry (field 'next_positions'; none: 0), up
    to the session's max_length (no step is longer)."""
    value = metadata.get("next_positions", 0)
    if not is_int(value) or value < 0:
        raise BadRequestError(f"field 'next_positions' must be an integer >= 0, got {value!r:.80}")
    return min(value, max_length)


def int_field(metadata: dict, name: str, low: int, high: int) -> int:
    value = metadata.get(name)
    if not is_int(value) or not low <= value <= high:
        raise BadRequestError(f"field {name!r} must be an integer in [{low}, {high}], got {value!r}")
    return value


# a step's id (field 'step_id'): a session's count of steps, which no session comes near; bounded like any field
MAX_STEP_ID = (1 << 53) - 1


def step_id_field(metadata: dict, required: bool = True):
    """A step's or a push's id, checked: an integer in [0, MAX_STEP_ID] (None where it may be left out)."""
    value = metadata.get("step_id")
    if value is None and not required:
        return None
    if not is_int(value) or not 0 <= value <= MAX_STEP_ID:
        raise BadRequestError(f"field 'step_id' must be an integer in [0, {MAX_STEP_ID}], got {value!r:.80}")
    return value
