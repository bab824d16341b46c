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
