"""The product's entry point: `python app.py`.

With no initial peers configured (--initial-peers or INITIAL_PEERS), it starts its own local swarm (a
bootstrap peer and two block servers that split the model's blocks, as child processes stopped on exit),
then streams a demo answer through it and, on a terminal, keeps answering prompts until EOF or Ctrl-C.
"""

from __future__ import annotations

import signal
import sys

DEMO_PROMPT = "Explain in three sentences what a swarm of block servers is."


def halves(num_blocks: int) -> list[tuple[int, int]]:
    middle = num_blocks // 2
    return [(0, middle), (middle, num_blocks)] if middle else [(0, num_blocks)]


def chat(args) -> None:
    from swarm.generate import run

    run(args)
    while sys.stdin.isatty():
        try:
            args.prompt = input("\nprompt> ").strip()
        except EOFError:
            return
        if args.prompt:
            run(args)


def main(argv=None) -> None:
    from config import SwarmSettings
    from swarm.cli import ArgumentParser, multiaddr, run_main, setup_logging

    settings = SwarmSettings.from_env()
    parser = ArgumentParser(prog="python app.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--initial-peers", nargs="*", type=multiaddr, default=list(settings.initial_peers))
    parser.add_argument("--model", default=settings.model)
    parser.add_argument("--prompt", default=DEMO_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    args.__dict__.update(
        chat=True, temperature=0.0, top_k=0, top_p=1.0, seed=None, dht_prefix=None, cache_dir=settings.cache_dir
    )
    setup_logging()
    # SIGTERM ends us like Ctrl-C does: through the `with` below, which stops the local swarm's processes
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    def body():
        if args.initial_peers:
            return chat(args)
        from swarm.local import LocalSwarm
        from swarm.weights import load_config, resolve_model

        num_blocks = load_config(resolve_model(args.model, settings.cache_dir)).num_hidden_layers
        print(f"starting a local swarm for {args.model} ...", file=sys.stderr, flush=True)
        with LocalSwarm(args.model, halves(num_blocks)) as swarm:
            args.initial_peers = swarm.initial_peers
            chat(args)

    run_main(body)


if __name__ == "__main__":
    main()
