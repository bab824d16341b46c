"""Saved states: a prefix (a system prompt, a tool preamble, a few-shot block) computed once on the swarm and kept
by name, as Ai00's states and llama.cpp's saved slots are kept.

    POST /v1/states {name, messages | prompt}   Engine.save_state: the prefix runs through the servers once
    a request whose prompt starts with it       forks it (engine/warm.py): its servers share the prefix's pages
                                                copy-on-write, and only the rest of the prompt is computed
    "state": name on a chat or text completion  the request starts with the state's messages or prompt

A state is its client's (and salt's) alone, like every warm conversation; a client keeps MAX_SAVED_STATES_PER_CLIENT
at most, and the gateway MAX_SAVED_STATES (each holds its prefix's hidden states here, for a server that drops it):
saving one more is a 429, given before its prefix is computed (`room` holds a place while it is), and saving a name
again replaces it. A state lives as long as the gateway's
process, or until deleted. On the servers its session is parked: a server short of room may evict it while no
fork shares its pages, and closes it after its --session-idle-timeout without forks; a fork of a state a server
has dropped recomputes the prefix there from what the gateway recorded of it, with the same output.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

from gateway.engine.warm import WarmConversations, WarmKey
from gateway.errors import NotFound, TooManySessions


@dataclass(eq=False)
class SavedState:
    name: str
    key: WarmKey
    session: object  # served.GatewaySession: its history is the state's tokens
    messages: Optional[list] = None  # the chat messages it was rendered from (None: a plain prompt)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokens(self) -> list[int]:
        return self.session.history

    def as_dict(self) -> dict:
        return {"object": "state", "name": self.name, "model": self.key.model, "tokens": len(self.tokens),
                "created": self.created, "kind": "messages" if self.messages is not None else "prompt"}


class SavedStates:
    def __init__(self, warm: WarmConversations, max_per_client: int, max_total: int):
        self.warm, self.max_per_client, self.max_total = warm, max_per_client, max_total
        self._states: dict[tuple[str, str], SavedState] = {}  # (client, name) ->
        self._saving: Counter[str] = Counter()  # per client: saves of new names under way, each holding a place
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._states)

    @contextmanager
    def room(self, client: str, name: str) -> Iterator[None]:
        """A place for the client's state `name`, held while its prefix is computed: over either cap, a 429 before
        the swarm is asked for anything. Saving a name again takes no more room."""
        with self._lock:
            new = (client, name) not in self._states
            if new:
                self._check_room(client, self._saving[client], self._saving.total())
                self._saving[client] += 1
        try:
            yield
        finally:
            if new:
                with self._lock:
                    self._saving[client] -= 1
                    if not self._saving[client]:
                        del self._saving[client]

    def _check_room(self, client: str, saving: int = 0, saving_total: int = 0) -> None:
        held = sum(1 for owner, _name in self._states if owner == client) + saving
        if held >= self.max_per_client:
            raise TooManySessions(f"this client has saved (or is saving) {held} states, the most it may "
                                  "(MAX_SAVED_STATES_PER_CLIENT); delete one first")
        if len(self._states) + saving_total >= self.max_total:
            raise TooManySessions(f"the gateway holds {self.max_total} saved states, the most it may "
                                  "(MAX_SAVED_STATES); delete one, or retry later")

    def save(self, state: SavedState) -> None:
        """Keep `state` (replacing the client's state of that name). Published and pinned in one step, so that a
        save or delete of the same name meanwhile lets go of exactly what it replaced."""
        client = state.key.client
        with self._lock:
            replaced = self._states.get((client, state.name))
            if replaced is None:
                self._check_room(client)  # its place was held (room), unless the name it replaced went meanwhile
            self._states[(client, state.name)] = state
            self.warm.pin(state.key, state.session)
            if replaced is not None:
                self.warm.unpin(replaced.session)
        if replaced is not None:
            replaced.session.close()  # forks of it keep their own references to the pages they share

    def get(self, client: str, name: str, field_name: str = "state") -> SavedState:
        state = self._states.get((client, name))
        if state is None:
            raise NotFound(f"{field_name}: no saved state named {name!r} (saved by this client)", field=field_name)
        return state

    def delete(self, client: str, name: str) -> None:
        with self._lock:
            state = self._states.pop((client, name), None)
            if state is not None:
                self.warm.unpin(state.session)
        if state is None:
            raise NotFound(f"no saved state named {name!r} (saved by this client)", field="name")
        state.session.close()

    def of(self, client: str) -> list[SavedState]:
        with self._lock:
            return [state for (owner, _name), state in self._states.items() if owner == client]
