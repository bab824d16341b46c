"""Saved states: a prefix (a system prompt, a tool preamble, a few-shot block) computed once on the swarm and kept
by name, as Ai00's states and llama.cpp's saved slots are kept.

    POST /v1/states {name, messages | prompt}   Engine.save_state: the prefix runs through the servers once
    a request whose prompt starts with it       forks it (engine/warm.py): its servers share the prefix's pages
                                                copy-on-write, and only the rest of the prompt is computed
    "state": name on a chat or text completion  the request starts with the state's messages or prompt

A state is its client's (and salt's) alone, like every warm conversation; a client keeps MAX_SAVED_STATES_PER_CLIENT
at most (saving one more is a 429), and saving a name again replaces it. A state lives as long as the gateway's
process, or until deleted. On the servers its session is parked: a server short of room may evict it while no
fork shares its pages, and closes it after its --session-idle-timeout without forks; a fork of a state a server
has dropped recomputes the prefix there from what the gateway recorded of it, with the same output.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

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
    def __init__(self, warm: WarmConversations, max_per_client: int):
        self.warm, self.max_per_client = warm, max_per_client
        self._states: dict[tuple[str, str], SavedState] = {}  # (client, name) ->
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._states)

    def save(self, state: SavedState) -> None:
        """Keep `state` (replacing the client's state of that name); over the client's cap, a 429."""
        client = state.key.client
        with self._lock:
            replaced = self._states.get((client, state.name))
            held = sum(1 for owner, _name in self._states if owner == client)
            if replaced is None and held >= self.max_per_client:
                raise TooManySessions(f"this client has saved {held} states, the most it may "
                                      "(MAX_SAVED_STATES_PER_CLIENT); delete one first")
            self._states[(client, state.name)] = state
        self.warm.pin(state.key, state.session)
        if replaced is not None:
            self._let_go(replaced)

    def get(self, client: str, name: str, field_name: str = "state") -> SavedState:
        state = self._states.get((client, name))
        if state is None:
            raise NotFound(f"{field_name}: no saved state named {name!r} (saved by this client)", field=field_name)
        return state

    def delete(self, client: str, name: str) -> None:
        with self._lock:
            state = self._states.pop((client, name), None)
        if state is None:
            raise NotFound(f"no saved state named {name!r} (saved by this client)", field="name")
        self._let_go(state)

    def of(self, client: str) -> list[SavedState]:
        with self._lock:
            return [state for (owner, _name), state in self._states.items() if owner == client]

    def _let_go(self, state: SavedState) -> None:
        self.warm.unpin(state.session)
        state.session.close()  # forks of it keep their own references to the pages they share
