"""The block server (`python -m swarm.server`): holds a span of a model's blocks and serves inference sessions.

In data-flow order, from the command line to the compute thread:

    settings.py    ServerSettings and ServerLimits, built once from the command line
    addresses.py   --public-address, --announce-maddrs: what it announces in place of where it listens
    main.py        the process: join the DHT, claim a span, load it, announce it (Presence), serve until stopped
    sizing.py      how many blocks it holds where no flag says: as many as its memory fits (--memory-budget)
    placement.py   where the server sits: the span it claims, when to move to one the swarm serves less
    throughput.py  what it announces as its speed (timed once per model, span, device and dtype; kept on disk)
    handler.py     the RPC handlers (swarm/wire.py's BlockRPC): decode, hand to the backend, encode, push on
    step_entries.py  a step message's entries: which steps flow, where each one's outputs are pushed on to
    timings.py     what a step message cost on the server (decode, queue, compute, reply), carried in its reply
    latency.py     --simulated-latency: every message in and out of the handlers (and pushes) held, as a WAN would
    links.py       --network-map: each caller's messages held by its own link (swarm/network_map.py), once
    round_trips.py the round trips of the server's pushes to the next servers, announced in its record
    backend.py     Backend: every request checked against the span and the limits on one client; it opens
                   sessions (handing each ServerServices) and submits cache-less forwards as jobs
    sessions.py    ServerSession: one client's session, its cache and steps (and steps pushed to it early)
    open_sessions.py  OpenSessions, the server's registry of them, and the ids of those it closed (used once)
    batching.py    Scheduler: the compute thread; submitted jobs (steps, forwards) go in rounds, prompts in chunks
    span.py        BlockSpan: the span's layers over a packed batch of sessions (swarm/families says how each computes)
    graphs.py      on CUDA, decode-only rounds captured once per shape bucket as CUDA graphs and replayed
    attention.py   a round's attention over the page pool, per group (decode, prefill, cacheless): a fixed number
                   of calls per layer, whatever the sessions
    cache.py       the page pool (KVPool), a session's page tables, and the server's budget of token slots
    quantize.py    int8 / nf4 weights with bitsandbytes
    metrics.py     Prometheus metrics of the server's load, in a registry of its own (--metrics-port)

The decode round's modules import one way, handler -> backend -> sessions, batching -> span -> graphs ->
attention -> cache: a session gets what it uses of the server as ServerServices, and DecodeGraphs gets the
span's forward at construction.

It never imports swarm.client: what both sides share lives at swarm/ (protocol, wire, dht, trust, weights,
families).
"""
