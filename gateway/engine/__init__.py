"""The engine: the one generation loop of the gateway, over the models it serves and the sessions open on them.
It never imports Flask: the dialects (and tools, and tests) drive it the same way.

In data-flow order:

    generation.py  Engine, the face the dialects use: served models (configured, or discovered in the swarm),
                   sessions opened, used and closed, and generate: GenerationRequest -> Delta, Delta, ... (text,
                   finish reason, logprobs), read from the request's output stream
    loop.py        EngineLoop, one per served model on a thread of its own: each tick embeds every ready session's
                   tokens in one call, starts their chain steps without waiting, runs the LM head once over every
                   row that came back and samples them in one batched call on the head's device
    turns.py       which ready sessions step once ENGINE_MAX_STEPS are in flight: turns shared between clients
    sequences.py   Sequence: one request's reply inside the loop (feed, drafts, verification, its end), and the one
                   writer of a session's token history
    outputs.py     a request's output stream (token ids from the loop) and its reader: detokenizing, stop sequences,
                   merged deltas for a reader that lags, one abort when the reader ends the reply
    sampler.py     Sampler per sequence, and sample_rows: a tick's rows sampled together, where the logits are
    catalogue.py   ServedModels: which models are served (configured; discovered ones as DISCOVERED_MODELS says, from
                   the gateway's own cache), their coverage without loading them, at most MAX_LOADED_MODELS loaded
    served.py      ServedModel (a model's client half: embeddings, LM head, tokenizer) and GatewaySession
    encoders.py    EmbeddingModels: the sentence-transformers encoders of EMBEDDING_MODELS, run whole in this process
    sessions.py    the open sessions: caps overall and per client, idle expiry, one request at a time
    session_store.py  sessions that outlive the process: an SQLite file (SESSION_STORE), reopened by id with a replay
    lengths.py     a request's token budget and context length checked, each a 400 naming its field
    sampling.py    SamplingParams, the one form every dialect's fields converge to, and each stage of sampling
    grammar.py     structured output: a token mask per step from a JSON schema, grammar or regex (llguidance)
    stops.py       stop sequences matched across token boundaries, never shown half
    stats.py       prefill and decode speeds of recent requests (MLC's /stats, mistral.rs's usage extras)
    metrics.py     time to first token, inter-token latency and generated tokens (Prometheus)
"""
