"""`python -m swarm.models --initial-peers MADDR`: the swarm's model catalogue, as the servers announce it.

One line per model: its name, DHT prefix, number of blocks, how many servers serve it, which blocks have
none, and where the client-side weights come from.
"""

from __future__ import annotations

from swarm.protocol import ModelRecord, format_block_ranges


def catalogue(client) -> list[tuple[ModelRecord, list, list]]:
    """(record, servers, missing block ranges) for every announced model."""
    from swarm import dht
    from swarm.routing import missing_ranges

    rows = []
    for record in client.loop.run(dht.fetch_catalogue(client.node, client.allowed_servers)):
        servers = client.servers(record.prefix, record.num_blocks)
        rows.append((record, servers, missing_ranges(servers, record.num_blocks)))
    return rows


def main(argv=None) -> None:
    from swarm.cli import ArgumentParser, multiaddr, run_main, settings_from_env, setup_logging

    settings = settings_from_env()
    parser = ArgumentParser(prog="python -m swarm.models", description="List the models a swarm serves.")
    parser.add_argument("--initial-peers", nargs="*", type=multiaddr, default=list(settings.initial_peers))
    args = parser.parse_args(argv)
    if not args.initial_peers:
        parser.error("--initial-peers is required (or set INITIAL_PEERS)")
    setup_logging()

    def body():
        from swarm.client import SwarmClient

        client = SwarmClient(args.initial_peers)
        try:
            rows = catalogue(client)
        finally:
            client.shutdown()
        print(f"{'model':32} {'prefix':32} {'blocks':>6} {'servers':>7}  coverage      source")
        for record, servers, missing in rows:
            coverage = "complete" if not missing else f"missing {format_block_ranges(missing)}"
            print(f"{record.name:32} {record.prefix:32} {record.num_blocks:>6} {len(servers):>7}  {coverage:13} {record.source}")
        if not rows:
            print("(no model is announced in this swarm)")

    run_main(body)


if __name__ == "__main__":
    main()
