"""The gateway's limits and its engine loop's policies: what one request and one client may take, and how the loop
drafts, groups and shares its steps. Every field is also an environment variable, its name in capitals, read with
the other settings by config.py (the only module that reads the environment), which exports Limits with them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

MAX_SPECULATIVE_TOKENS = 32  # a step of more positions than this is a prefill, priced and batched as one


@dataclass(frozen=True)
class Limits:
    """What one request, and one client, may take. A client is its API key when keys are configured, else its IP.

    Each field is also an environment variable: its name in capitals (MAX_SESSIONS, ...)."""

    max_sessions: int = 256  # open inference sessions per gateway process, HTTP and WebSocket together
    max_sessions_per_client: int = 16  # of those, how many one client may hold at once (0: no cap of its own)
    session_idle_timeout: float = 600.0  # seconds; an idle HTTP session is then closed on the servers too
    ws_idle_timeout: float = 600.0  # seconds without a message from its client closes a WebSocket (0: never)
    max_new_tokens: int = 4096  # the most one request may ask for
    max_body_bytes: int = 1 << 20  # an HTTP request's body; a larger one is refused with 413
    requests_per_minute: int = 600  # per client: API requests and WebSocket messages (0: no limit)
    ws_ping_interval: float = 25.0  # keep-alive pings on WebSocket connections, seconds
    # seconds an idle keep-alive HTTP connection stays open (gunicorn's keepalive; said in each reply's Keep-Alive
    # header): longer than common clients keep one (Node's undici 4 s, httpx 5 s), so that none reuses a connection
    # the gateway has just closed without a word, and above a load balancer's usual 60 s
    http_keepalive: float = 65.0
    http_header_timeout: float = 20.0  # seconds a request's headers may take to arrive (web/slow_clients.py)
    half_open_per_address: int = 128  # one address's connections whose request headers are still awaited
    ws_max_message_bytes: int = 1 << 20  # a larger WebSocket message closes the connection (code 1009)
    # stored replies of the Responses API (store: true), kept in this process's memory like sessions: a cap on their
    # number (the least recently used goes first) and idle expiry
    max_stored_responses: int = 1024
    stored_response_idle_timeout: float = 3600.0  # seconds since it was created or last read
    # A WebSocket holds one of gunicorn's threads for its whole life (flask-sock), so the caps on them size the
    # threads (worker_threads): over either cap the handshake is refused with a 429, before the upgrade
    max_websockets: int = 1000  # open WebSocket connections per gateway process
    max_websockets_per_client: int = 32  # of those, how many one client may hold at once (0: no cap of its own)
    http_threads: int = 64  # threads for the HTTP requests that hold no session (/health, /metrics, models, ...)
    # models whose client half (embeddings, LM head, tokenizer) this process holds at once, configured ones included:
    # past it the least recently used is let go (sessions open on it keep it until they end)
    max_loaded_models: int = 4
    # the work one API request may ask for without a session of its own, and the Responses store's bytes. Embeddings (/v1/embeddings, Ollama's /api/embed) and /v1/chooses run one cache-less swarm forward per
    # input: their inputs (OpenAI's cap of 2,048) and tokens are capped per request (400 naming the field), and each
    # such request holds one of its client's session slots while it runs (MAX_SESSIONS_PER_CLIENT)
    max_inputs_per_request: int = 2048
    max_input_tokens_per_request: int = 65536  # all of one request's inputs together
    max_stored_response_bytes: int = 64 << 20  # stored responses together, as JSON; the biggest holder gives way
    # finished conversations kept open on the swarm, so that a request continuing one sends only its new tokens
    # (gateway/engine/warm.py): how many per gateway process (0: none), and per client; the least recent go first
    warm_sessions: int = 64
    warm_sessions_per_client: int = 8
    # prefixes saved by name (POST /v1/states: engine/saved_states.py), per gateway process and per client: each
    # holds a parked session on the servers and its prefix's hidden states in the gateway, as long as it lives
    max_saved_states: int = 64
    max_saved_states_per_client: int = 8
    # speculative decoding (gateway/engine/speculation.py): the most tokens drafted per step, each verified by the
    # swarm in the same step; fewer when measured steps and acceptance say more would not pay; 0: one token per step
    speculative_tokens: int = 8
    # drafting is the engine loop's policy: only while at most this many sessions of a model decode together, since
    # each guess costs a position of every server's round (gateway/engine/loop.py); 0: never draft
    speculative_max_sessions: int = 4
    # the engine loop's pipeline (gateway/engine/loop.py): past this many sessions of a model decoding together,
    # they travel in groups (0: a group per server of a session's chain; 1: one, every session in step)
    pipeline_min_sessions: int = 8
    pipeline_groups: int = 0
    # past this many steps of a model's sessions in flight (0: no bound), sessions take turns (gateway/engine/turns.py)
    engine_max_steps: int = 0
    engine_sharing: str = "client"  # the turns shared between clients (each one's sessions share its part), or session

    def __post_init__(self):
        if self.max_loaded_models < 1:
            raise ValueError(f"MAX_LOADED_MODELS must be at least 1, got {self.max_loaded_models}")
        if not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"SPECULATIVE_TOKENS must be between 0 and {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.speculative_tokens}")
        if self.speculative_max_sessions < 0:
            raise ValueError(f"SPECULATIVE_MAX_SESSIONS must be 0 or more, got {self.speculative_max_sessions}")
        if not (self.http_header_timeout > 0 and self.half_open_per_address >= 1):  # NaN fails too
            raise ValueError(f"HTTP_HEADER_TIMEOUT must be above 0 and HALF_OPEN_PER_ADDRESS at least 1, got "
                             f"{self.http_header_timeout} and {self.half_open_per_address}")
        if self.pipeline_groups < 0 or self.pipeline_min_sessions < 1:
            raise ValueError(f"PIPELINE_GROUPS, PIPELINE_MIN_SESSIONS: >= 0, >= 1, got {self.pipeline_groups}, "
                             f"{self.pipeline_min_sessions}")
        if self.engine_max_steps < 0 or self.engine_sharing not in ("client", "session"):
            raise ValueError(f"ENGINE_MAX_STEPS >= 0, ENGINE_SHARING client or session: got {self.engine_max_steps}, "
                             f"{self.engine_sharing!r}")

    @property
    def worker_threads(self) -> int:
        """gunicorn's threads: one per WebSocket, one per session an HTTP request may hold while it generates, and
        http_threads besides, so that neither kind can take the threads the other needs (/health stays answered)."""
        return self.max_websockets + self.max_sessions + self.http_threads

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "Limits":
        values = {}
        for name in cls.__dataclass_fields__:
            if environ.get(name.upper()):
                kind = type(getattr(cls, name))
                try:
                    values[name] = kind(environ[name.upper()])
                except ValueError:
                    raise ValueError(f"{name.upper()}: expected {kind.__name__}, got {environ[name.upper()]!r}") from None
        return cls(**values)
