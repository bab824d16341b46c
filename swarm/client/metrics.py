"""Prometheus metrics of a swarm client: its retries, failovers and spot checks.

They live in prometheus_client's default registry, so whatever process runs a SwarmClient (the gateway)
exposes them with its own metrics. Importing this module only creates metric objects: no thread, no socket.
"""

from __future__ import annotations

from prometheus_client import Counter

RETRIES = Counter("swarm_client_retries_total", "Steps of a session sent again to a server after a failure")
FAILOVERS = Counter("swarm_client_failovers_total", "Servers of a session's chain replaced by others after a failure")
SPOT_CHECKS = Counter("swarm_client_spot_checks_total",
                      "Steps whose outputs other servers recomputed (swarm/client/spot_check.py), by outcome: agreed, "
                      "caught (a lying server was banned) or unresolved", ["outcome"])
