"""`python -m swarm.server`: see swarm/server/main.py."""

from swarm.server.main import main

main()
