"""The product's entry point: the gateway (Petals Chat HTTP and WebSocket APIs) in front of a swarm.

    gunicorn app:app --worker-class gthread --threads 100 --bind HOST:PORT
    python app.py [--host 127.0.0.1] [--port 5000] [--initial-peers MADDR ...] [--model NAME]

With no initial peers configured (--initial-peers or INITIAL_PEERS), it starts an embedded local swarm:
a bootstrap peer and two block servers per served model, as child processes stopped when it exits.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gateway import create_app

app = create_app()  # cheap: the swarm client is built in the worker, on the first request that needs it


def main(argv=None) -> None:
    from swarm.cli import ArgumentParser, multiaddr

    parser = ArgumentParser(prog="python app.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--initial-peers", nargs="*", type=multiaddr, help="join this swarm instead of a local one")
    parser.add_argument("--model", help="the model to serve: a known name or a Hugging Face folder")
    args = parser.parse_args(argv)

    environment = []  # handed to gunicorn, which sets it before the master's hooks and the worker read config
    if args.initial_peers:
        environment += ["--env", "INITIAL_PEERS=" + " ".join(args.initial_peers)]
    if args.model:
        environment += ["--env", f"MODEL={args.model}"]
    sys.argv = [
        "gunicorn", "--config", str(Path(__file__).with_name("gunicorn.conf.py")),
        "--bind", f"{args.host}:{args.port}", *environment, "app:app",
    ]
    from gunicorn.app.wsgiapp import run

    run()


if __name__ == "__main__":
    main()
