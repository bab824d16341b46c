"""The block server (`python -m swarm.server`): holds a span of a model's blocks and serves inference sessions.

In data-flow order, from the command line to the compute thread:

    settings.py    ServerSettings, built once from the command line
    main.py        the process: join the DHT, claim a span, load it, announce it (Presence), serve until stopped
    placement.py   where the server sits: the span it claims, when to move to one the swarm serves less
    throughput.py  what it announces as its speed (timed once per model, span, device and dtype; kept on disk)
    handler.py     the RPC handlers (swarm/wire.py's BlockRPC): decode, hand to the backend, encode, push on
    backend.py     ServerLimits and Backend: every request checked against the span and the limits on one client
    sessions.py    ServerSession: one client's session, its cache and steps (and steps pushed to it early)
    batching.py    the compute thread: continuous batching of decode steps, chunked prefill
    span.py        BlockSpan: the span's layers over a packed batch of sessions (families.py says how each runs)
    attention.py   a round's attention over the page pool: a fixed number of calls per layer, whatever the sessions
    graphs.py      on CUDA, decode rounds captured once per shape bucket as CUDA graphs and replayed
    cache.py       the page pool (KVPool), a session's page tables, and the server's budget of token slots
    quantize.py    int8 / nf4 weights with bitsandbytes
    metrics.py     Prometheus metrics of the server's load, in a registry of its own (--metrics-port)

It never imports swarm.client: what both sides share lives at swarm/ (protocol, wire, dht, trust, weights,
families).
"""
