"""What the engine serves: a model's client half on the swarm (ServedModel), and inference sessions on it
(GatewaySession). generation.py runs the one generation loop over them."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from config import ModelConfig
from gateway.engine.speculation import StepCosts
from gateway.errors import BadRequest

logger = logging.getLogger(__name__)

CATALOGUE_SECONDS = 5.0  # how long the swarm's model catalogue (and its servers' limits) is trusted before asking again
UNKNOWN_CONTEXT = 2048  # a model whose config names no context (BLOOM's ALiBi has no trained maximum)


class ServedModel:
    """A model the gateway serves: the client half of it (embeddings, LM head, tokenizer) on the swarm. A
    "model:adapter" is a view of its `parent`, the model's: what depends on the tokenizer alone (its grammars, its
    draft model: see drafts.py) is the parent's, made once however many adapters are asked for."""

    def __init__(self, config: ModelConfig, remote, parent: Optional["ServedModel"] = None):
        self.configured, self.remote = config, remote  # remote: swarm.client.RemoteModel
        self.parent = parent or self
        self.tokenizer = remote.tokenizer
        self.stop_ids = remote.stop_token_ids  # the one stop rule (python -m swarm.client.generate's too)
        self._grammars, self._grammars_lock = None, threading.Lock()
        self.step_costs = StepCosts()  # what its decode steps cost, by positions: how long drafts pay to be
        self._swarm_context: tuple[float, Optional[int]] = (-CATALOGUE_SECONDS, None)  # (when asked, answer)
        self._let_go = False

    @property
    def let_go(self) -> bool:
        """Whether the catalogue let it go (MAX_LOADED_MODELS), or its parent: sessions open on it still run, and its
        engine loop ends once none does (loop.py)."""
        return self._let_go or (self.parent is not self and self.parent.let_go)

    def let_go_of(self) -> None:
        self._let_go = True

    @property
    def name(self) -> str:
        return self.configured.name

    @property
    def config(self) -> ModelConfig:
        """The configured model, with its context length resolved (see max_session_length)."""
        return replace(self.configured, max_session_length=self.max_session_length)

    @property
    def max_session_length(self) -> int:
        """The longest session (prompt and reply) it serves: see session_length."""
        trained = getattr(self.remote.config, "max_position_embeddings", None)
        return session_length(self.configured, trained, self._swarm_longest_session)

    def _swarm_longest_session(self) -> Optional[int]:
        asked_at, longest = self._swarm_context
        if time.monotonic() - asked_at >= CATALOGUE_SECONDS:
            remote = self.remote
            try:
                longest = remote.client.longest_session(remote.prefix, remote.num_blocks)
            except Exception:  # servers unreachable now: the model's own context stands until they answer
                logger.debug("could not ask the swarm how long a session it holds", exc_info=True)
                longest = None
            self._swarm_context = (time.monotonic(), longest)
        return longest

    @property
    def vocab_size(self) -> int:
        return self.remote.config.vocab_size

    def grammars(self):
        """What compiles grammars against this model's tokenizer, built on first use (it takes a moment)."""
        if self.parent is not self:
            return self.parent.grammars()
        with self._grammars_lock:
            if self._grammars is None:
                from gateway.engine.grammar import TokenizerGrammars

                self._grammars = TokenizerGrammars(self.tokenizer, self.vocab_size, eos_token_ids=self.stop_ids)
            return self._grammars

    def encode(self, text: str, at_start: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=at_start)["input_ids"]

    def check_token_ids(self, ids: list[int], field: str) -> None:
        """Token ids a client sent (a prompt, a context, ids to decode) must be in the vocabulary."""
        if any(not 0 <= token < self.vocab_size for token in ids):
            raise BadRequest(f"{field}: token ids must be in [0, {self.vocab_size})", field=field)


def session_length(configured: ModelConfig, trained: Optional[int], swarm_longest: Callable[[], Optional[int]]) -> int:
    """The longest session (prompt and reply) a model serves: the configured one if set (an override), else what
    the model was trained for, bounded by the longest session the swarm's servers can hold now (if known)."""
    if configured.max_session_length is not None:
        return configured.max_session_length
    trained = trained or UNKNOWN_CONTEXT
    held = swarm_longest()
    return min(trained, held) if held else trained


@dataclass(eq=False)
class GatewaySession:
    """One inference session: the remote session on the servers, and what the gateway knows of it."""

    model: ServedModel
    inference: object  # swarm.client.InferenceSession: the session on the swarm's servers
    max_length: int
    expires: bool  # HTTP sessions expire when idle; a WebSocket's lives as long as its connection
    owner: str = ""  # the client that opened it (access.client_id), for the per-client cap
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    history: list[int] = field(default_factory=list)  # token ids in the servers' caches
    pending: list[int] = field(default_factory=list)  # the last sampled token, shown but not yet sent
    reply_start: Optional[int] = None  # session length where the last reply began: regenerate rewinds there
    state: dict = field(default_factory=dict)  # what a dialect keeps to continue it (JSON values), stored with it
    stored: bool = False  # a session clients name by id: kept in the session store, so that it outlives a restart
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    # who may continue it once its request is done (engine/warm.py): None for sessions of their own (HTTP, WebSocket)
    warm_key: Optional[object] = None
    broken: bool = False  # a step failed: the servers' caches may not hold `history`, so it is never reused
    # ends the reply the engine loop is computing for it, if any, and waits until no step of it is in flight
    abort_reply: Optional[Callable[[], None]] = None

    def forked(self, length: int) -> "GatewaySession":
        """A new session whose servers share this one's first `length` positions (copy-on-write) rather than
        computing them again; this one goes on unchanged."""
        return GatewaySession(self.model, self.inference.fork(length), self.max_length, self.expires, self.owner,
                              history=self.history[:length], warm_key=self.warm_key)

    @contextlib.contextmanager
    def waits_told_to(self, hook: Optional[Callable[[str], None]]):
        """Within the block, `hook(message)` is told whenever a step waits for a server of some blocks."""
        inference = self.inference if hook is not None else None
        if inference is not None:
            inference.on_wait = hook
        try:
            yield
        finally:
            if inference is not None:
                inference.on_wait = None

    def settle(self) -> None:
        """End the reply the engine loop is still computing for it, if any (its reader was dropped unclosed: an
        exception on its way up), and wait until the session's token history is final."""
        abort = self.abort_reply
        if abort is not None:
            abort()

    def close(self) -> None:
        """Free the servers' caches; safe to call twice and from any thread. A reply still running (its reader
        not closed yet: an exception on its way up) is ended first: no step of it reaches a closed server session."""
        self.closed = True
        self.settle()
        inference, self.inference = self.inference, None
        if inference is not None:
            try:
                inference.close()
            except Exception:  # the servers free the cache when the stream breaks, too
                logger.warning("closing session %s failed", self.id, exc_info=True)
