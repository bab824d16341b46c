"""The benchmark suite, `python -m bench`: the default model (or a named shape with random weights, --shape)
served by two block servers (blocks 0:15 and 15:30 of the default model) beside transformers running the
whole model in one process, in one run and with the same torch thread count in every process, on the CPU
or on a GPU (--device cuda: servers, local baseline and the gateway's embeddings and LM head).

It measures, as token arrival times turned into tokens/s, time to first token (TTFT) and inter-token
latency (ITL):
  - greedy replies to one chat prompt: local transformers `generate`, the swarm's Python client
    (swarm.client.RemoteModel + swarm.client.generate), and a real gunicorn gateway over its WebSocket API
    (/api/v2/generate) and its OpenAI-compatible API (/v1/chat/completions, streamed);
  - TTFT of a 512-token prompt through the gateway, against one local forward pass over it (prefill);
  - 1, 4, 16 and 64 simultaneous WebSocket sessions (1, 8, 32, 64 on a GPU): aggregate and per-session
    tok/s, TTFT and ITL p50/p95;
  - each block server's resident memory (GPU memory on a GPU) against its blocks' weights plus its cache budget;
  - one round of 1, 8, 32 and 64 sessions through the model's blocks alone (no RPC), on the tiny test model's
    shape and on the benchmarked model: decode rounds and verify rounds (1 + a draft's positions), eager and
    through the graphs servers run: what each session adds to a server's round;
  - over each concurrency run, what every process did: each block server's rows per round, graphed and eager
    rounds (from its Prometheus metrics), the CPU per generated token of the gateway, each server and the
    bootstrap peer, and on a GPU its utilisation;
and checks the ratios of issue 6 against their targets (and the decode rounds' 64 sessions vs 1). Single
sessions decode the same way on every path (--speculative-tokens: plain by default).

In data-flow order:

    __main__.py  the command line: run, report
    options.py   the flags of `python -m bench` and `python -m bench.span_round`, and their CPU and GPU defaults
    shapes.py    models of named real shapes with random weights, built once into the cache
    span_round.py  one round of a span alone (load_span, new_cache, use_graphs, forward_packed), per kind of
                 round and count of sessions
    suite.py     one run: per dtype, start the swarm and the gateway, alternate the measurements, sample memory
    workload.py  the prompts (text and token ids) and the session lengths they need
    local.py     the baseline: transformers generate and prefill in this process
    clients.py   one reply, timed token by token: Python client, WebSocket, OpenAI SSE
    load.py      many simultaneous WebSocket sessions
    usage.py     what every process did over a concurrency run: servers' rounds (their /metrics), CPU per
                 token, GPU utilisation
    gateway.py   a real gunicorn gateway in front of a given swarm, as a child process
    memory.py    block servers' VmRSS/VmHWM (and their p2pd's; on a GPU, nvidia-smi's figure), their weights and
                 cache budget in bytes
    stats.py     token arrival times -> TTFT, ITL, tok/s; percentiles and medians
    report.py    the targets, the table, JSON and the plot

Beside the suite, each its own command: prefix_share.py and reuse.py (issue 22: saved prefixes, conversations kept
warm); wan.py (decode speed at simulated round trips, speculation on and off; its prompts in wan_prompts.py);
churn/ (the churn harness: servers leaving and joining under live sessions); routing_cost.py (what routing's
DHT lookups and choose_chain cost as a swarm grows: docs/wan.md); flowing.py (flowing steps against relayed
ones through 2, 4 and 8 hops of a simulated network map); audits.py (issue 41: the audit judge's calibration on
honest servers, and what it detects of hostile ones at a rate: docs/security.md).
"""
