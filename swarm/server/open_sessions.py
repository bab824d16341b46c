"""The server's registry of open sessions (swarm/server/sessions.py's ServerSession joins it while open), and of
the ids of the sessions it closed lately.

A session's id is used once: a step or a push naming a closed session's id comes late (it crossed the close on
its way: the close travels on the session's inference stream, steps and pushes on their own) and is refused
before anything is allocated for it, and no new session may take the id over, where a late push of the old one
would land. The ids are remembered up to CLOSED_IDS_KEPT (a client makes new ones at random; the oldest go
first), so that a flood of short sessions costs the server a bounded amount of memory.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Iterator

CLOSED_IDS_KEPT = 1 << 16  # at 64 characters each, some 8 MB at most


class OpenSessions:
    """The server's open sessions: every one (idle ones may be closed to make room), those a previous server
    may push steps to (by id), how many each peer has open, and what they have computed. Its sessions are
    sessions.py's ServerSession (not imported: sessions.py imports this module)."""

    def __init__(self):
        self._all: set = set()
        self.by_id: dict = {}  # session id -> its ServerSession
        self.per_peer: Counter[str] = Counter()
        self.positions_served = 0  # positions run through sessions: shows what clients re-send
        self.steps_pushed = 0  # steps started from the previous server's push, before the client's copy came
        self._closed_ids: OrderedDict[str, None] = OrderedDict()  # least recently closed first

    def add(self, session) -> None:
        self._all.add(session)
        self.per_peer[session.peer_id] += 1
        if session.id is not None:
            self.by_id[session.id] = session

    def discard(self, session) -> None:
        self._all.discard(session)
        self.per_peer -= Counter([session.peer_id])  # a peer with none left leaves the counter
        if session.id is not None and self.by_id.get(session.id) is session:
            del self.by_id[session.id]
            self._closed_ids[session.id] = None
            while len(self._closed_ids) > CLOSED_IDS_KEPT:
                self._closed_ids.popitem(last=False)

    def closed(self, session_id) -> bool:
        """Whether `session_id` names a session this server closed lately (by its client, or itself)."""
        return isinstance(session_id, str) and session_id in self._closed_ids

    def __iter__(self) -> Iterator:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)
