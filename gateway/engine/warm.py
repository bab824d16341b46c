"""Conversations kept warm on the swarm: a finished request's session stays open on its servers, parked, so that
the next request continuing it (the same chat with one more turn, a Responses follow-up, an Ollama `context`, a
regenerate) sends only its new tokens instead of recomputing the whole history on every server of the chain.

    take(key, prompt_ids) -> Reuse | None   the parked session sharing the longest prefix with the prompt
    park(key, session)                      a finished session, kept for the next request (least recent go first)

Reuse never crosses keys: a key is the model, the client (its API key, or its address when the gateway has none:
access.client_id) and the `cache_salt` a client may give, so no client is ever answered from another's cache, and
none can learn another's prompts by timing. An address is everyone behind one NAT or proxy, though: where it is all
that names a client (no API keys), only requests that gave a cache_salt, a secret they hold, keep or reuse anything
(`salt_only`), unless KEYLESS_SHARING says those behind an address are one user.

Within a key, the longest common prefix of token ids wins, cut to whole pages of the servers' caches (PAGE_TOKENS):
what a request is told it reused (`cached_tokens` in every API's usage, and the prompt tokens it says it computed)
tells only to a page how much of it matched. The servers rewind to it (a step at an earlier position overwrites the
rest), so a history edited in the middle or a divergent branch is computed again from where it differs, never
answered from the wrong prefix.

A session that continues a parked one whole (or but for a few tokens) is taken (it leaves the pool); one that
shares only part of it forks it (the servers share the prefix's pages copy-on-write), leaving the parked conversation whole for its own
next turn. Saved states (saved_states.py) are pinned here: never taken, never given way, only forked. Parked sessions cost the servers nothing they need: each server evicts its parked
sessions first when it needs room (their next step then fails over and recomputes: the output is the same), and
a session in use is never parked. Here, the pool is bounded overall and per client (WARM_SESSIONS,
WARM_SESSIONS_PER_CLIENT), the least recently parked going first.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Optional

from gateway.engine.sequences import forget_after
from swarm.protocol import PAGE_TOKENS

logger = logging.getLogger(__name__)

# A prefix shorter than this is not worth holding a conversation for: another request may continue it whole
MIN_SHARED_TOKENS = PAGE_TOKENS
# A conversation that a prompt leaves at most this many tokens of is taken and rewound rather than forked: a reply
# rendered back into a chat often tokenizes a little differently at its end, and keeping that tail is not worth a
# second session
SHORT_TAIL_TOKENS = PAGE_TOKENS


@dataclass(frozen=True)
class WarmKey:
    """Who may reuse a cache: reuse never crosses keys."""

    model: str
    client: str  # access.client_id(): an API key's digest, or an address
    salt: str = ""  # a client's cache_salt: its own requests apart from each other


@dataclass
class Reuse:
    """A session for a new request, its first `cached` prompt tokens already in the servers' caches."""

    session: object  # served.GatewaySession, history cut to the shared prefix
    cached: int


def shared_prefix(tokens: list[int], prompt: list[int]) -> int:
    """How many leading tokens the two lists share."""
    length = 0
    for ours, theirs in zip(tokens, prompt):
        if ours != theirs:
            break
        length += 1
    return length


class WarmConversations:
    def __init__(self, max_sessions: int, max_per_client: int, salt_only: bool = False):
        """`salt_only`: keep and reuse only the conversations of requests that gave a cache_salt (see above)."""
        self.max_sessions, self.max_per_client = max_sessions, max_per_client or max_sessions
        self.salt_only = salt_only
        self._parked: OrderedDict[int, tuple[WarmKey, object]] = OrderedDict()  # id(session) -> ..., oldest first
        self._forking: Counter[int] = Counter()  # parked sessions being forked now
        self._pinned: dict[int, tuple[WarmKey, object]] = {}  # saved states (saved_states.py): only ever forked
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._parked)

    def take(self, key: WarmKey, prompt: list[int], max_length: int) -> Optional[Reuse]:
        """A session for `prompt` (the whole request to fit in `max_length`) continuing the parked session of `key`
        that shares the longest prefix with it (at least MIN_SHARED_TOKENS), cut to whole pages, or None."""
        if not self._keeps(key):
            return None
        with self._lock:
            found = self._best(key, prompt, max_length)
            if found is None:
                return None
            session, shared = found
            cached = shared - shared % PAGE_TOKENS
            short_tail = len(session.history) - shared <= SHORT_TAIL_TOKENS
            if short_tail and not self._forking[id(session)] and id(session) not in self._pinned:
                del self._parked[id(session)]  # it continues the conversation (near enough) whole: the request takes it
                forget_after(session, cached)
                return Reuse(session, cached)
            self._forking[id(session)] += 1  # nobody takes it whole (and rewinds it) while its pages are shared
        try:
            forked = _fork(session, cached)
        finally:
            with self._lock:
                self._forking[id(session)] -= 1
                if not self._forking[id(session)]:
                    del self._forking[id(session)]
        return Reuse(forked, cached) if forked is not None else None

    def _best(self, key: WarmKey, prompt: list[int], max_length: int) -> Optional[tuple[object, int]]:
        best, cached = None, 0
        for session_key, session in [*self._parked.values(), *self._pinned.values()]:
            if session_key != key or session.max_length < max_length:
                continue
            # the last prompt token is always sent: its step gives the logits of the reply's first token
            shared = min(shared_prefix(session.history, prompt), len(prompt) - 1)
            if shared > cached:
                best, cached = session, shared
        return (best, cached) if best is not None and cached >= MIN_SHARED_TOKENS else None

    def park(self, key: WarmKey, session) -> None:
        """Keep `session` for a later request of `key`; the least recently parked give way past the caps."""
        if self.max_sessions <= 0 or not self._keeps(key) or session.closed or not session.history:
            session.close()
            return
        try:
            session.inference.park()  # its servers may now evict it first when they need room
        except Exception:  # a server gone: the next step fails over and recomputes, as after any eviction
            logger.debug("parking session %s failed", session.id, exc_info=True)
        evicted = []
        with self._lock:
            self._parked[id(session)] = (key, session)
            held = [parked for parked_key, parked in self._parked.values() if parked_key.client == key.client]
            for parked in held[: max(len(held) - self.max_per_client, 0)]:
                evicted.append(self._parked.pop(id(parked))[1])
            while len(self._parked) > self.max_sessions:
                evicted.append(self._parked.popitem(last=False)[1][1])
        for parked in evicted:
            parked.close()

    def _keeps(self, key: WarmKey) -> bool:
        return bool(key.salt) or not self.salt_only

    def pin(self, key: WarmKey, session) -> None:
        """Keep `session` for requests of `key` until unpinned: a saved state, which they only ever fork."""
        with self._lock:
            self._pinned[id(session)] = (key, session)

    def unpin(self, session) -> None:
        with self._lock:
            self._pinned.pop(id(session), None)

    def close_all(self) -> None:
        with self._lock:
            parked, self._parked = list(self._parked.values()), OrderedDict()
        for _key, session in parked:
            session.close()


def _fork(session, length: int):
    """A new session sharing the first `length` positions of `session`'s caches, or None if that failed (the
    request then starts afresh: its prompt is computed whole)."""
    try:
        return session.forked(length)
    except Exception as error:
        logger.warning("forking session %s failed (%r); computing the prompt afresh", session.id, error)
        return None
