"""`python -m swarm.client.catalogue --initial-peers MADDR`: the swarm's model catalogue, as the servers announce it.

One line per model: its name, DHT prefix, number of blocks, how many servers serve it, which blocks have
none, where the client-side weights come from, and the LoRA adapters its servers announce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarm.protocol import ModelRecord

if TYPE_CHECKING:
    from swarm.client.swarm_client import Coverage


def catalogue(client) -> list[tuple[ModelRecord, Coverage, list[str]]]:
    """Every announced model, how well the swarm covers it, and the LoRA adapters its servers announce."""
    return [(record, client.coverage(record.prefix, record.num_blocks),
             sorted(client.adapters(record.prefix, record.num_blocks))) for record in client.catalogue()]


def main(argv=None) -> None:
    from swarm.cli import ArgumentParser, multiaddr, run_main, settings_from_env, setup_logging

    settings = settings_from_env()
    parser = ArgumentParser(prog="python -m swarm.client.catalogue", description="List the models a swarm serves.")
    parser.add_argument("--initial-peers", nargs="*", type=multiaddr, default=list(settings.initial_peers))
    args = parser.parse_args(argv)
    if not args.initial_peers:
        parser.error("--initial-peers is required (or set INITIAL_PEERS)")
    setup_logging()

    def body():
        from swarm.client.swarm_client import SwarmClient

        client = SwarmClient(args.initial_peers, allowed_servers=settings.allowed_servers)
        try:
            rows = catalogue(client)
        finally:
            client.shutdown()
        print(f"{'model':32} {'prefix':32} {'blocks':>6} {'servers':>7}  coverage      source  adapters")
        for record, coverage, adapters in rows:
            blocks = "complete" if coverage.covered else f"missing {coverage.missing_blocks}"
            print(f"{record.name:32} {record.prefix:32} {record.num_blocks:>6} {coverage.servers:>7}  {blocks:13} "
                  f"{record.source}  {' '.join(adapters) or '-'}")
        if not rows:
            print("(no model is announced in this swarm)")

    run_main(body)


if __name__ == "__main__":
    main()
