"""The engine: the one generation loop of the gateway, over the models it serves and the sessions open on them.
It never imports Flask: the dialects (and tools, and tests) drive it the same way.

In data-flow order:

    generation.py  Engine: the served models (configured, or discovered in the swarm), sessions opened and closed,
                   and the loop itself: GenerationRequest -> Delta, Delta, ... (text, finish reason, logprobs)
    catalogue.py   ServedModels: which models are served (configured; discovered ones as DISCOVERED_MODELS says, from
                   the gateway's own cache), their coverage without loading them, at most MAX_LOADED_MODELS loaded
    served.py      ServedModel (a model's client half: embeddings, LM head, tokenizer) and GatewaySession
    encoders.py    EmbeddingModels: the sentence-transformers encoders of EMBEDDING_MODELS, run whole in this process
    sessions.py    the open sessions: caps overall and per client, idle expiry, one request at a time
    session_store.py  sessions that outlive the process: an SQLite file (SESSION_STORE), reopened by id with a replay
    lengths.py     a request's token budget and context length checked, each a 400 naming its field
    sampling.py    SamplingParams, the one form every dialect's fields converge to, and the Sampler per sequence
    grammar.py     structured output: a token mask per step from a JSON schema, grammar or regex (llguidance)
    stops.py       stop sequences matched across token boundaries, never shown half
    stats.py       prefill and decode speeds of recent requests (MLC's /stats, mistral.rs's usage extras)
    metrics.py     time to first token, inter-token latency and generated tokens (Prometheus)
"""
