"""The entries of a step message (rpc_steps' metadata "steps", one map per step), read for the handler: which steps
flow (their inputs come pushed, see swarm/server/pushes.py) and where a step's outputs are pushed on to."""

from __future__ import annotations

import functools
from typing import Optional

from hivemind.p2p import PeerID

from swarm.protocol import BadRequestError
from swarm.server.fields import is_int


def flowing(entry) -> bool:
    return isinstance(entry, dict) and entry.get("await_push") is True


def sent_entries(entries: list) -> list:
    """The entries of the steps whose inputs the message carries (a flowing step's come pushed)."""
    return [entry for entry in entries if not flowing(entry)]


def with_flowing(entries: list, sent_steps: list) -> list:
    """Each entry's step: its inputs, or None for a flowing step."""
    sent = iter(sent_steps)
    return [None if flowing(entry) else next(sent) for entry in entries]


def check_flowing_shape(entry: dict, batch_size: int) -> None:
    rows, length = entry.get("rows"), entry.get("length")
    if not (is_int(rows) and is_int(length) and length >= 1):
        raise BadRequestError("a flowing step must say its 'rows' and 'length' (integers >= 1)")
    if rows != batch_size:
        raise BadRequestError(f"this session has batch size {batch_size}, got {rows}")


def push_target(metadata: dict) -> Optional[tuple[PeerID, str]]:
    target = metadata.get("push_to")
    if target is None:
        return None
    if not (isinstance(target, dict) and isinstance(target.get("peer_id"), str)
            and isinstance(target.get("session_id"), str)):
        raise BadRequestError("field 'push_to' must be a map with a 'peer_id' and a 'session_id'")
    try:
        return peer_id_of(target["peer_id"]), target["session_id"]
    except Exception:
        raise BadRequestError(f"push_to: {target['peer_id']!r:.80} is not a peer id") from None


@functools.lru_cache(maxsize=1024)
def peer_id_of(text: str) -> PeerID:
    """A peer id from its base58 text, once per peer: decoding it (and hivemind's encoding it back) was an eighth
    of the event loop's samples on messages of 64 steps, each naming one of the same few next servers."""
    return PeerID.from_base58(text)
