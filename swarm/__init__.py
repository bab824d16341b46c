"""The distributed model: everything that knows about block servers, the DHT and remote sessions.

In data-flow order:

    weights.py   resolve a model name or folder; convert the shipped GGUF once; read only the tensors asked for
    cache.py     a session's attention cache, growing a page at a time, and the server's budget of token slots
    blocks.py    a span of decoder layers run over packed batches of sessions (every family quirk lives here)
    batching.py  the server's compute thread: continuous batching of decode steps, chunked prefill
    protocol.py  DHT key scheme, the ServerInfo record, the SwarmError tree that crosses the wire
    trust.py     identity keys, and the DHT record validator: only records signed under their writer's subkey
    dht.py       the process's event loop, DHT nodes, announcing and finding servers; `python -m swarm.dht`
    rpc.py       the block server's RPC: handlers and client stubs over libp2p
    server.py    a block server; `python -m swarm.server`
    routing.py   pure choices: the chain that serves a session, the span a new server takes, when to move
    placement.py a server's place in the swarm: claiming a span at start, moving to even the swarm out
    client.py    SwarmClient and RemoteSession: hidden states through a chain of servers
    coalesce.py  concurrent row-wise calls merged into one (the client's LM head for sessions decoding at once)
    spot_check.py  now and then, other servers recompute a hop of a step; a liar is banned
    model.py     RemoteModel: embeddings -> remote blocks -> norm -> LM head; session(max_length).step(ids)
    decoding.py  logits -> token (greedy, temperature, top-k, top-p), and a streaming detokenizer
    generate.py  `python -m swarm.generate`, an operator's quick check
    models.py    `python -m swarm.models`, the catalogue of models the swarm serves
    local.py     LocalSwarm: a bootstrap peer and block servers as child processes on this machine
    metrics.py   Prometheus metrics: the client's retries and failovers, a block server's load (--metrics-port)
    cli.py       what the command-line tools share: one-line errors, never a traceback

This package never imports flask or gateway; torch, transformers and hivemind load only when used.
"""
