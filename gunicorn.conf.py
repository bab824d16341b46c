"""gunicorn's settings for `gunicorn app:app` run from this folder (gunicorn reads this file by itself).

Threads, not workers: an HTTP inference session lives in the process that opened it (as in Petals Chat).
With no initial peers configured, the master starts an embedded local swarm before it forks the worker,
and stops it when it exits (Ctrl-C and SIGTERM included).
"""

import os

worker_class = "gthread"
workers = 1
threads = 100
bind = ["127.0.0.1:5000"]
timeout = 120
graceful_timeout = 10
# gunicorn's control socket has one default path per user: two gateways on one machine would fight over it
control_socket_disable = True

_local_swarm = None


def on_starting(server):
    """Start the embedded swarm in the master, before the fork: the worker finds it through INITIAL_PEERS."""
    global _local_swarm
    from config import Settings

    settings = Settings.from_env()
    if settings.swarm.initial_peers:
        return
    from swarm.local import start_for_models

    server.log.info("no initial peers configured: starting a local swarm")
    _local_swarm = start_for_models(settings)
    os.environ["INITIAL_PEERS"] = " ".join(_local_swarm.initial_peers)
    server.log.info("local swarm ready: %s", os.environ["INITIAL_PEERS"])


def on_exit(server):
    if _local_swarm is not None:
        _local_swarm.stop()
