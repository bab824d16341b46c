"""The one generation loop of the repository, over the served models and sessions of served.py.

    request (schema) --dialect--> GenerationRequest --Engine.generate--> Delta, Delta, ... (text + finish)

Every dialect (Petals, OpenAI, Anthropic, Ollama) calls `Engine.generate`; none has a loop of its own. Each step sends
only the new tokens through the swarm: the servers' caches hold the rest of the session.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from config import ModelConfig, Settings
from gateway.errors import BadRequest, LengthExceeded, NotFound
from gateway.engine.lengths import check_max_length
from gateway.engine.metrics import CACHED_PROMPT_TOKENS, observe_token
from gateway.engine.loop import EngineLoop
from gateway.engine.outputs import Delta, ReplyReader, TokenLogprob, detokenizer, inputs_taken
from gateway.engine.sampler import Sampler
from gateway.engine.sampling import SamplingParams
from gateway.engine.sequences import Sequence, token_logprob
from gateway.engine.sequences import rewind as rewind_tokens
from gateway.engine.catalogue import ServedModels
from gateway.engine.served import GatewaySession, ServedModel
from gateway.engine.stats import EngineStats, RequestStats
from gateway.engine.sessions import SessionRegistry
from gateway.engine.drafts import DraftModels, ReplyDrafts
from gateway.engine.encoders import EmbeddingModels
from gateway.engine.speculation import Pacing
from gateway.engine.session_store import open_store, reopen_session
from gateway.engine.stops import StopMatcher
from gateway.engine.saved_states import SavedState, SavedStates
from gateway.engine.warm import WarmConversations, WarmKey

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationRequest:
    inputs: Optional[str]  # new text appended to the session (None: continue from where it stopped)
    sampling: SamplingParams
    max_new_tokens: Optional[int]  # None: until a stop or the session's length
    max_length: Optional[int] = None  # a cap on the session's total length for this request
    stop_sequences: tuple[str, ...] = ()
    include_stop: bool = True  # Petals clients get the matched stop sequence in the text; OpenAI's don't
    input_ids: tuple[int, ...] = ()  # new tokens given as ids (after `inputs`, if both are given)
    stop_token_ids: tuple[int, ...] = ()  # besides the model's own end-of-sequence tokens
    logprobs: Optional[int] = None  # None: off; k: each token's log-probability and the k likeliest
    constraint: Optional[Callable[[], object]] = None  # a fresh grammar.Constraint: structured output


class Engine:
    def __init__(self, settings: Settings, connect: Optional[Callable[[ModelConfig], object]] = None):
        """`connect(model_config) -> RemoteModel` builds a model's client half; the default joins the swarm (and
        reads its catalogue: an engine given its own `connect` discovers no model)."""
        self.settings = settings
        self.limits = settings.gateway.limits
        self._client = None  # one swarm client (a DHT node) for every model of this process
        self._client_lock = threading.Lock()
        self.models = ServedModels(settings, connect or self._connect_to_swarm,
                                   self.swarm_client if connect is None else lambda: None)
        self.sessions = SessionRegistry(self.limits.max_sessions, self.limits.session_idle_timeout,
                                        self.limits.max_sessions_per_client, open_store(settings.gateway.session_store),
                                        reopen=lambda stored: reopen_session(self, stored))
        self.stats = EngineStats()
        self.warm = WarmConversations(self.limits.warm_sessions, self.limits.warm_sessions_per_client,
                                      salt_only=not settings.gateway.access.keeps_caller_state)
        self.states = SavedStates(self.warm, self.limits.max_saved_states_per_client, self.limits.max_saved_states)
        self.draft_models = DraftModels(settings.swarm.cache_dir)
        # EMBEDDING_MODELS, run in this process: their folders are checked now, and each loads on first use
        self.encoders = EmbeddingModels(settings.gateway.embedding_models, settings.gateway.device)
        self._loops: dict[ServedModel, EngineLoop] = {}  # one engine loop per served model, started on first use

    # ----------------------------------------------------------------------------------- models

    def model_config(self, name: Optional[str]) -> ModelConfig:
        """A configured model, else one the swarm's catalogue announces that this gateway serves."""
        self.encoders.refuse_chat(name)
        return self.models.config(name)

    def discovered_models(self) -> list[ModelConfig]:
        """Models the swarm's servers announce that config.py does not name, as DISCOVERED_MODELS serves them."""
        return self.models.discovered_configs()

    def listed_models(self) -> list[dict]:
        """Every configured model (with whether the swarm covers it), and every discovered one it covers."""
        return self.models.listed()

    def model(self, name: Optional[str]) -> ServedModel:
        """The model's client half, loaded by the first request that needs it (see catalogue.py)."""
        self.encoders.refuse_chat(name)
        return self.models.get(name)

    def loaded_models(self) -> list[ServedModel]:
        """The models this process holds loaded (Ollama's /api/ps)."""
        return self.models.loaded()

    def swarm_client(self):
        with self._client_lock:
            if self._client is None:
                import torch

                from swarm.client import SwarmClient

                swarm = self.settings.swarm
                if swarm.torch_threads:  # the embeddings, LM head and sampling of this process
                    torch.set_num_threads(swarm.torch_threads)
                self._client = SwarmClient(swarm.initial_peers, wire_dtype=getattr(torch, swarm.wire_dtype),
                                           allowed_servers=swarm.allowed_servers,
                                           spot_check_rate=swarm.spot_check_rate, audit_rate=swarm.audit_rate,
                                           block_wait=swarm.block_wait_seconds)
            return self._client

    def _connect_to_swarm(self, config: ModelConfig):
        import torch

        from swarm.client import RemoteModel

        gateway = self.settings.gateway  # where this process runs the model's embeddings, final norm and LM head
        # errors name the model as clients do; its prefix is the one servers derive from their --model
        return RemoteModel.on_client(self.swarm_client(), config.path, self.settings.swarm.cache_dir,
                                     config.dht_prefix, name=config.name, device=gateway.device,
                                     dtype=getattr(torch, gateway.dtype), revision=config.revision)

    def coverage(self, name: Optional[str]) -> dict:
        """Whether the swarm now holds every block of the model, and how many servers serve it (no weights
        are loaded for it)."""
        return self.models.coverage(name)

    def swarm_health(self, name: Optional[str]) -> dict:
        """What the swarm looks like for one model: every server that announced a block of it (joining and
        offline ones too), how many online servers hold each block, and the blocks none holds."""
        health = self.models.health(name)
        return {
            "num_blocks": health.num_blocks,
            "coverage": health.servers_per_block,
            "covered": health.covered,
            "missing_ranges": [list(block_range) for block_range in health.missing],  # half-open [start, end)
            "missing_blocks": health.missing_blocks,
            "servers": [
                {"peer_id": server.peer_id, "start": server.info.start, "end": server.info.end,
                 "state": server.info.state.name.lower(), "throughput": server.info.throughput,
                 "cache_tokens_free": server.info.cache_tokens_free, "version": server.info.version,
                 "relayed": server.info.relayed,  # reached through a relay (behind a NAT)
                 "caught_lying": server.peer_id in health.caught_lying,  # distrusted (swarm/client/audits.py)
                 # the round trip this gateway measures to it (null: not measured yet, offline, or not answering)
                 "rtt_ms": round(health.round_trips[server.peer_id] * 1000, 1)
                 if server.peer_id in health.round_trips else None}
                for server in health.servers
            ],
        }

    # ----------------------------------------------------------------------------------- sessions

    def open_session(self, model_name: Optional[str], max_length: int, expires: bool, owner: str = "") -> GatewaySession:
        model = self.model(model_name)
        check_max_length(model.config, max_length)
        with self.sessions.reserve(owner):
            session = GatewaySession(model, model.remote.session(max_length), max_length, expires, owner)
            self.sessions.add(session)
        return session

    def use_session(self, session_id: str, client: Optional[str] = None):
        """`with engine.use_session(id[, client]) as session:` one request at a time on a session (sessions.use)."""
        return self.sessions.use(session_id, client)

    def resume_session(self, session_id: str, client: str) -> GatewaySession:
        """A session named by a new connection (a WebSocket's resume), reopened from the store if need be."""
        return self.sessions.resume(session_id, client)

    def keep_session(self, session: GatewaySession) -> None:
        """Clients name it by id from now on: it is kept in the session store and outlives a restart."""
        self.sessions.keep(session)

    def detach_session(self, session: GatewaySession) -> None:
        """Its connection ended: it leaves this process, the store keeps it for a resume."""
        self.sessions.detach(session)

    def session_slot(self, client: str):
        """`with engine.session_slot(client):` a slot among the client's sessions, for work that opens none."""
        return self.sessions.reserve(client)

    @property
    def open_sessions(self) -> int:
        return len(self.sessions)

    @property
    def max_sessions_per_client(self) -> int:
        return self.sessions.max_per_client

    def saved_state(self, client: str, name: str) -> SavedState:
        """A prefix the client saved by name (POST /v1/states), or a 404 naming it."""
        return self.states.get(client, name)

    def close_session(self, session: GatewaySession) -> None:
        self.sessions.remove(session)
        session.close()

    def open_for_prompt(self, model: ServedModel, prompt_ids: list[int], max_length: int, owner: str,
                        salt: str = "", choices: int = 1) -> tuple[GatewaySession, int]:
        """A session for one request's prompt, and how many of its tokens the servers hold already: a warm
        conversation of the same client continued (see warm.py), else a new session. Either way it may be
        continued by a later request of the same client once `finish_session` has parked it. `choices`: the
        request's n, each a session on the servers (choices.py holds the forks' slots): refused now, before any
        reply begins, if the caps have no room for them all."""
        check_max_length(model.config, max_length)
        self._check_choices(choices)
        key = WarmKey(model.name, owner, salt)
        with self.sessions.reserve(owner, choices):
            reuse = self.warm.take(key, prompt_ids, max_length)
            if reuse is not None:
                session, cached = reuse.session, reuse.cached
                session.owner = owner
                CACHED_PROMPT_TOKENS.labels(model.name).inc(cached)
            else:
                session, cached = self._warm_session(model, key, max_length), 0
            self.sessions.add(session)
        return session, cached

    def _check_choices(self, choices: int) -> None:
        """n choices that no client could ever hold at once are a 400, not a 429 to retry."""
        most = min(self.sessions.max_per_client, self.sessions.max_sessions)
        if choices > most:
            raise BadRequest(f"n: at most {most} choices here, each holds one of the client's inference sessions "
                             f"(MAX_SESSIONS_PER_CLIENT), got {choices}", field="n")

    @staticmethod
    def _warm_session(model: ServedModel, key: WarmKey, max_length: int = 0) -> GatewaySession:
        """A new session that later requests of `key` may continue: as long as the model allows, since a later
        turn must fit in it too (servers take cache as a session grows, never its max_length up front)."""
        longest = max(model.config.max_session_length, max_length)
        return GatewaySession(model, model.remote.session(longest), longest, False, key.client, warm_key=key)

    def save_state(self, model: ServedModel, name: str, prompt_ids: list[int], owner: str, salt: str = "",
                   messages: Optional[list] = None) -> SavedState:
        """Run `prompt_ids` through the swarm once and keep them by `name` for `owner`'s requests to fork
        (see saved_states.py); saving a name again replaces it."""
        check_max_length(model.config, len(prompt_ids))
        key = WarmKey(model.name, owner, salt)
        # the caps are checked before the swarm computes anything, and the prefill holds one of the client's slots
        with self.states.room(owner, name), self.sessions.reserve(owner):
            session = self._warm_session(model, key)
            try:
                self.prefill(session, prompt_ids)  # every token into the servers' caches: what forks of it share
                # parked: a server short of room may evict it while no fork shares its pages (forks recompute it)
                session.inference.park()
                state = SavedState(name, key, session, messages)
                self.states.save(state)
            except BaseException:
                session.close()
                raise
        return state

    def finish_session(self, session: GatewaySession) -> None:
        """A request is done with its session: kept warm for the client's next request if it can be (see
        open_for_prompt), else closed."""
        session.settle()
        self.sessions.remove(session)
        if session.warm_key is None or session.broken or session.closed:
            session.close()
        else:
            self.warm.park(session.warm_key, session)

    # ----------------------------------------------------------------------------------- the loop

    def generate(self, session: GatewaySession, request: GenerationRequest,
                 cancelled: Callable[[], bool] = lambda: False, stats: Optional[RequestStats] = None) -> Iterator[Delta]:
        """Append the request's inputs to the session and stream the reply. The caller holds session.lock.

        The reply is computed by the model's engine loop, beside every other session's; this thread only reads its
        tokens and makes text of them. `cancelled` is asked between tokens (a stop message, a client gone); `stats`
        collects the timings of one API request across its choices (default: a record of its own in engine.stats)."""
        yield from self.start_reply(session, request, cancelled, stats)

    def generate_choices(self, session: GatewaySession, requests: list[GenerationRequest],
                         cancelled: Callable[[], bool] = lambda: False, stats: Optional[RequestStats] = None):
        """(index, delta) of n replies to one prompt, forks of one prefill decoded together (see choices.py)."""
        from gateway.engine.choices import generate_choices

        yield from generate_choices(self, session, requests, cancelled, stats)

    def start_reply(self, session: GatewaySession, request: GenerationRequest,
                    cancelled: Callable[[], bool] = lambda: False, stats: Optional[RequestStats] = None
                    ) -> Iterator[Delta]:
        """generate's work up to its reply's start (checked, and submitted to the loop); the deltas then come from
        the iterator it returns."""
        sequence, deltas = self.prepare_reply(session, request, cancelled, stats)
        self.loop_of(session.model).submit(sequence)
        return deltas

    def prepare_reply(self, session: GatewaySession, request: GenerationRequest,
                      cancelled: Callable[[], bool] = lambda: False, stats: Optional[RequestStats] = None
                      ) -> tuple[Sequence, Iterator[Delta]]:
        """A reply checked and ready, and the iterator of its deltas, for the caller to submit to the model's loop
        (several at once: n choices start in the same tick)."""
        session.settle()  # a reply before this one left unclosed ends first
        if session.closed:
            raise NotFound(f"inference session {session.id} is closed", field="session_id")
        model = session.model
        feed, used, budget = self._feed_and_budget(session, request)
        sequence = self._sequence(session, request, feed, budget)
        stopper = StopMatcher(request.stop_sequences, request.include_stop)  # before any work: it checks the stops
        stats = stats or self.stats.begin()
        stats.prompt(len(feed))
        session.reply_start = used
        loop = self.loop_of(model)
        if budget == 0:  # nothing to generate: just take the inputs into the servers' caches
            return sequence, inputs_taken(sequence)

        def on_token(first: bool) -> None:  # one clock for /stats, usage timings and the latency metrics
            observe_token(model.name, stats.step_done(first=first), first=first)

        reader = ReplyReader(sequence.stream, detokenizer(model.tokenizer, sequence.start), stopper,
                             functools.partial(loop.abort, sequence), cancelled, on_token)
        session.abort_reply = lambda: loop.abort(sequence, reader.count)
        return sequence, reader.deltas_of(session, sequence)

    def loop_of(self, model: ServedModel) -> EngineLoop:
        """The model's engine loop (started on first use)."""
        with self._client_lock:
            if model not in self._loops:
                self._loops[model] = EngineLoop.under(self.limits, model, on_end=self._forget_loop)
            return self._loops[model]

    def _forget_loop(self, loop: EngineLoop) -> None:
        """A let-go model's loop ended (its sessions have): the engine holds neither any longer."""
        with self._client_lock:
            if self._loops.get(loop.model) is loop:
                del self._loops[loop.model]

    def _sequence(self, session: GatewaySession, request: GenerationRequest, feed: list[int], budget: int) -> Sequence:
        model = session.model
        sampler = Sampler(request.sampling, model.vocab_size, context=session.history + feed,
                          device=model.remote.head_device)
        constraint = request.constraint() if request.constraint else None
        stop_ids = model.stop_ids | set(request.stop_token_ids)
        return Sequence(session, feed, budget, sampler, constraint, stop_ids, request.logprobs,
                        *self._speculation(model))

    def prefill(self, session: GatewaySession, ids: list[int]) -> None:
        """Take `ids` into the session's servers' caches through the engine loop (a saved prefix, a stored session's
        replay), and wait until they are."""
        sequence = Sequence(session, session.pending + ids, 0, Sampler(SamplingParams(), session.model.vocab_size),
                            None, set(), None)
        self.loop_of(session.model).submit(sequence)
        sequence.wait()

    def _speculation(self, model: ServedModel) -> tuple[Optional[Pacing], Optional[ReplyDrafts]]:
        """How one reply drafts tokens (see speculation.py): its pacing (None: one token per step), and its draft
        model's guesses if the model has one."""
        most = self.limits.speculative_tokens
        if not most:
            return None, None
        draft_model = self.draft_models.of(model)
        return Pacing(model.step_costs, most), draft_model.reply() if draft_model is not None else None

    @staticmethod
    def _feed_and_budget(session: GatewaySession, request: GenerationRequest) -> tuple[list[int], int, int]:
        """The tokens to send first (the pending one, then the request's), the session's length once they
        are in, and how many tokens the reply may have."""
        new_ids = session.model.encode(request.inputs, at_start=not session.history) if request.inputs else []
        feed = session.pending + new_ids + list(request.input_ids)
        if not feed:
            raise BadRequest("inputs: required to start a session's first generation", field="inputs")
        limit = session.max_length if request.max_length is None else min(session.max_length, request.max_length)
        used = len(session.history) + len(feed)
        if used > limit:
            raise LengthExceeded(
                f"the inputs need {used} tokens, over the session's max_length of {limit}; "
                "open a session with a larger max_length",
                field="max_length" if request.max_length else "inputs",
            )
        budget = limit - used if request.max_new_tokens is None else min(request.max_new_tokens, limit - used)
        return feed, used, budget

    @staticmethod
    def rewind(session: GatewaySession, length: int) -> None:
        """Forget everything after the first `length` tokens (another choice for the same prompt, a regenerate):
        the servers overwrite their caches from there, so the prompt is not computed again."""
        session.settle()
        rewind_tokens(session, length)

    # ----------------------------------------------------------------------------------- scoring

    def token_logprobs(self, model_name: Optional[str], ids: list[int], top: int = 0) -> list[Optional[TokenLogprob]]:
        """Each token's log-probability given the ones before it (None for the first), in one cache-less pass."""
        logits = self.model(model_name).remote.forward([ids])[0]  # (length, vocab)
        return [None] + [token_logprob(logits[index - 1], ids[index], top) for index in range(1, len(ids))]

    def embed(self, model_name: Optional[str], ids: list[int], layer: Optional[int]) -> list[float]:
        """Mean-pooled hidden states after `layer` blocks (default: the last, after the final norm)."""
        remote = self.model(model_name).remote
        if layer is not None and layer > remote.num_blocks:
            raise BadRequest(f"layer: at most {remote.num_blocks} for this model, got {layer}", field="layer")
        return remote.hidden_states([ids], layer)[0].mean(dim=0).tolist()
