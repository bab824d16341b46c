"""`python -m swarm.server`, and the installed `swarm-server` command: see swarm/server/main.py. The flags are
checked before torch and the rest load."""

from swarm.server.settings import parse_settings


def main() -> None:
    settings = parse_settings()
    from swarm.server.main import launch  # heavy: torch, transformers, hivemind

    launch(settings)


if __name__ == "__main__":
    main()
