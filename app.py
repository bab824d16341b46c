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
    # MLC's server flags (and its older --allow-* spellings)
    parser.add_argument("--api-key", action="append", help="require this API key (repeatable)")
    parser.add_argument("--api-key-file", help="require one of the keys in this file (one per line)")
    parser.add_argument("--allowed-origins", "--allow-origins", nargs="+", help="CORS origins (default: *)")
    parser.add_argument("--allowed-methods", "--allow-methods", nargs="+", help="CORS methods (default: *)")
    parser.add_argument("--allowed-headers", "--allow-headers", nargs="+", help="CORS headers (default: *)")
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    args = parser.parse_args(argv)

    # handed to gunicorn, which sets them before the master's hooks and the worker read config.py
    settings = {
        "INITIAL_PEERS": " ".join(args.initial_peers or []),
        "MODEL": args.model,
        "API_KEYS": ",".join(args.api_key or []),
        "API_KEY_FILE": args.api_key_file,
        "ALLOWED_ORIGINS": ",".join(args.allowed_origins or []),
        "ALLOWED_METHODS": ",".join(args.allowed_methods or []),
        "ALLOWED_HEADERS": ",".join(args.allowed_headers or []),
        "ALLOW_CREDENTIALS": "true" if args.allow_credentials else "",
    }
    environment = [part for name, value in settings.items() if value for part in ("--env", f"{name}={value}")]
    sys.argv = [
        "gunicorn", "--config", str(Path(__file__).with_name("gunicorn.conf.py")),
        "--bind", f"{args.host}:{args.port}", *environment, "app:app",
    ]
    from gunicorn.app.wsgiapp import run

    run()


if __name__ == "__main__":
    main()
