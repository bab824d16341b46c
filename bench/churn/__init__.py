"""The churn harness, `python -m bench.churn`: block servers leaving and joining under live sessions, on loopback.

In data-flow order:

    __main__.py  the command line
    run.py       one run: model, local replies, bootstrap, servers, two gateways, churn and sessions, read-out
    model.py     the tiny deep random model (built once into the cache) and the local model's greedy replies
    fleet.py     the block servers: spans, round trips, identities; start, stop, kill, rejoin; their timeline
    churn.py     the cycle of leaves and joins, never leaving a block unserved
    sessions.py  the workers generating through both gateways' OpenAI API
    chains.py    the chains the gateways logged, against the best chain through the servers live then
    summary.py   the summary (JSON) and its printout with the issue's targets
"""
