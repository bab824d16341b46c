"""Prometheus metrics of a swarm client: its retries, failovers, waits for blocks and spot checks.

They live in prometheus_client's default registry, so whatever process runs a SwarmClient (the gateway)
exposes them with its own metrics. Importing this module only creates metric objects: no thread, no socket.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

RETRIES = Counter("swarm_client_retries_total", "Steps of a session sent again to a server after a failure")
FAILOVERS = Counter("swarm_client_failovers_total", "Servers of a session's chain replaced by others after a failure")
FAILOVER_CAUSES = Counter("swarm_client_failover_causes_total",
                          "Failovers by the failed server's error code: server_unavailable (dead, stalled, cut off, "
                          "or lying), internal_error (it failed on its own), cache_full or server_limit", ["cause"])
for _cause in ("server_unavailable", "internal_error", "cache_full"):
    FAILOVER_CAUSES.labels(_cause)
BLOCK_WAITS = Counter("swarm_client_block_waits_total",
                      "Sessions and requests that found no server for some of their blocks and waited for one "
                      "(BLOCK_WAIT_SECONDS at most), by outcome: served (a server came), gave_up, or abandoned (the "
                      "client that waited went away)", ["outcome"])
for _outcome in ("served", "gave_up"):
    BLOCK_WAITS.labels(_outcome)
WAITING_FOR_BLOCKS = Gauge("swarm_client_waiting_for_blocks",
                           "Sessions and requests waiting now for a server to hold their blocks again")
AUDITS = Counter("swarm_client_audits_total",
                 "Hops of ended sessions recomputed by other servers (swarm/client/audits.py), by outcome: passed, "
                 "caught (a lying server distrusted), unresolved, no_auditor (no other server holds the blocks), "
                 "dropped (too many waiting) or failed", ["outcome"])
SPOT_CHECKS = Counter("swarm_client_spot_checks_total",
                      "Steps whose outputs other servers recomputed (swarm/client/spot_check.py), by outcome: agreed, "
                      "caught (a lying server was banned) or unresolved", ["outcome"])
