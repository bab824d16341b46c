"""`python -m swarm.server`: see swarm/server/main.py. The flags are checked before torch and the rest load."""

from swarm.server.settings import parse_settings

settings = parse_settings()

from swarm.server.main import launch  # noqa: E402  (heavy: torch, transformers, hivemind)

launch(settings)
