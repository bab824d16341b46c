"""`python -m bench.scale`: the swarm's DHT and routing at 100 to 10,000 block servers, measured on this machine.

    python -m bench.scale [--servers 100,1000] [--nodes 16] [--blocks 80] [--lookups 5] [--budget 300]
                          [--seed 0] [--key-cache PATH] [--json PATH]

--nodes real hivemind DHT nodes on 127.0.0.1 (swarm.dht.start_node, each with its libp2p daemon) run in a child
process and hold the signed records of N simulated servers, for each N of --servers: each its own RSA identity
key, span, speed and link delays (bench/scale_population.py states the distribution), announced once through
swarm.dht.announce, as a server announces each period (bench/scale_hosts.py: how many keys sign through a few
nodes). A gateway node in this process (client mode, as a gateway's) then looks the model up --lookups times
through swarm.dht.fetch_servers and chooses chains over what it found with routing.choose_chain, given every
server's true round trip and compute as if measured.

Servers announce in tenths of N, until all have or --budget seconds of announcing are spent (with one record per
block, announcing costs grow with the records a key already holds: N = 1,000 takes hours on 2 cores); the rest of
the run goes on with the servers announced, and says how many. Reported per N: the announce's time, its DHT
traffic per server (protobuf bytes of every RPC the nodes sent and
got back, replication's included; libp2p's framing and encryption not counted), records per key; a lookup's time,
bytes and RPCs, the servers it found; choose_chain's time with and without flowing steps. The layout of records
is whatever swarm/dht.py writes. Prints a Markdown table; exits 0. --json writes every figure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from typing import Optional

QUICK_SET = (100, 1000)


def start_hosts(nodes: int, key_cache: Optional[str]):
    """The child process of DHT nodes (bench.scale_hosts.serve): (process, connection, its multiaddrs)."""
    from bench.scale_hosts import serve

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=serve, args=(theirs, nodes, key_cache), daemon=True)
    process.start()
    if not ours.poll(180):
        process.kill()
        raise RuntimeError(f"the {nodes} DHT nodes did not start within 180 s")
    return process, ours, ours.recv()


def stop_hosts(process, connection) -> None:
    try:
        connection.send(("stop",))
        connection.poll(30) and connection.recv()
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()


def measure(connection, gateway, counter, servers: int, options) -> dict:
    """Announce `servers` simulated servers, then look them up and route over them from the gateway."""
    from bench.scale_hosts import difference
    from swarm.client.routing import choose_chain
    from swarm.dht import EventLoop, fetch_servers

    prefix = f"scale-{servers}-{options.seed}"
    connection.send(("announce", {"servers": servers, "blocks": options.blocks, "seed": options.seed,
                                  "prefix": prefix, "budget": options.budget}))
    announced, truths = connection.recv()
    loop, lookups = EventLoop.get(), []
    for _ in range(options.lookups):
        before, began = counter.snapshot(), time.perf_counter()
        found = loop.run(fetch_servers(gateway, prefix, options.blocks))
        lookups.append({"seconds": time.perf_counter() - began, "found": len(found),
                        **difference(counter.snapshot(), before)})
    rtt = {server.peer_id: server.client_rtt for server in truths}
    measured = {server.peer_id: server.seconds_per_block for server in truths}
    choice = {"relayed": None, "flowing": None}
    for flowing in (False, True) if found else ():  # nothing found (every lookup RPC failed): no chain to choose
        times = []
        for _ in range(5):
            began = time.perf_counter()
            choose_chain(found, options.blocks, prefix, measured=measured, rtt=rtt, flowing=flowing)
            times.append(time.perf_counter() - began)
        choice["flowing" if flowing else "relayed"] = statistics.median(times)
    return {"servers": servers, "announce": announced, "lookups": lookups, "choose_chain_seconds": choice}


def row(figures: dict) -> str:
    announced, lookups = figures["announce"], figures["lookups"]
    batches, per_key = announced["batches"], announced["records_per_key"] or [0]
    done = announced["announced"]
    total = sum(batch["sent"] + batch["received"] for batch in batches)
    last = batches[-1] if batches else {"sent": 0, "received": 0, "servers": 1, "seconds": 0.0, "calls": 0}
    lookup_bytes = statistics.median(look["sent"] + look["received"] for look in lookups)
    return (f"| {figures['servers']:,}{'' if done == figures['servers'] else f' ({done:,} announced)'} "
            f"| {sum(batch['seconds'] for batch in batches):.1f} s "
            f"| {total / max(done, 1) / 1e3:,.0f} kB ({(last['sent'] + last['received']) / last['servers'] / 1e3:,.0f} kB, "
            f"{last['calls'] / last['servers']:.0f} RPCs); {total / max(len(per_key), 1) / 1e3:,.0f} kB per key "
            f"| {len(per_key)} keys: median {statistics.median(per_key):g}, max {max(per_key)} "
            f"| {statistics.median(look['seconds'] for look in lookups):.2f} s "
            f"(max {max(look['seconds'] for look in lookups):.2f}) | {lookup_bytes / 1e6:.2f} MB, "
            f"{statistics.median(look['calls'] for look in lookups):g} RPCs "
            f"{_failed(lookups)}| {min(look['found'] for look in lookups):,} | {_milliseconds(figures)} |")


def _failed(lookups: list[dict]) -> str:
    failed = statistics.median(look["failed"] for look in lookups)
    return f"({failed:g} failed) " if failed else ""


def _milliseconds(figures: dict) -> str:
    seconds = figures["choose_chain_seconds"]
    if seconds["flowing"] is None:
        return "no server found"
    return f"{seconds['relayed'] * 1e3:.1f} / {seconds['flowing'] * 1e3:.1f} ms"


HEADER = ("| servers | announcing them all | announce traffic per server (the last tenth's, RPCs); per key | records per key "
          "| lookup time, median | lookup bytes and RPCs | servers found (fewest) | choose_chain relayed / flowing |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")


def parse_options(argv=None) -> argparse.Namespace:
    numbers = lambda text: [int(item) for item in text.split(",") if item]  # noqa: E731
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=numbers, default=list(QUICK_SET),
                        help="simulated servers, a run per number (100,1000; 10000 takes minutes of key "
                             "generation the first time)")
    parser.add_argument("--nodes", type=int, default=16, help="real DHT nodes holding the records (16)")
    parser.add_argument("--blocks", type=int, default=80, help="the model's blocks (80: a 70B-class model)")
    parser.add_argument("--lookups", type=int, default=5, help="lookups timed per N (5)")
    parser.add_argument("--budget", type=float, default=300.0,
                        help="seconds of announcing per N at most: servers announce in tenths, and the run goes on "
                             "with those announced when it is spent (300)")
    parser.add_argument("--seed", type=int, default=0, help="spans, speeds and places of the servers (0)")
    parser.add_argument("--key-cache", help="where generated identity keys are kept across runs "
                                            "(default: ~/.cache/swarm-bench/scale-keys.pickle)")
    parser.add_argument("--json", help="write every figure here")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    from bench.scale_hosts import RpcBytes
    from swarm.dht import EventLoop, start_node

    options = parse_options(argv)
    process, connection, maddrs = start_hosts(options.nodes, options.key_cache)
    results = []
    try:
        gateway = EventLoop.get().run(start_node(initial_peers=maddrs, client_mode=True))
        counter = RpcBytes().install(gateway)
        print(HEADER, flush=True)
        for servers in options.servers:
            results.append(measure(connection, gateway, counter, servers, options))
            print(row(results[-1]), flush=True)
            if options.json:  # after each N: a long run stopped midway keeps what it measured
                with open(options.json, "w") as file:
                    json.dump({"options": vars(options), "results": results}, file, indent=1)
        EventLoop.get().run(gateway.shutdown())
    finally:
        stop_hosts(process, connection)
    return results


if __name__ == "__main__":
    main()
