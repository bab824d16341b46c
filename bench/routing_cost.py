"""`python -m bench.routing_cost`: what routing costs a client as a swarm grows (the figures of docs/wan.md).

    python -m bench.routing_cost [--servers 16,100,1000,10000] [--blocks 24,30,80] [--span-fraction 0.3]
                                 [--repeats 20] [--flowing-repeats 20] [--links 16]

Measures, in this process (no swarm needed):
  - the bytes of one server's record as the DHT stores it under each of its blocks (signed, under its owner
    subkey), and so the bytes a routing lookup would bring back with one record per server per block it holds,
    each fetched once (what a lookup really brings back, with whatever layout swarm/dht.py writes:
    `python -m bench.scale`);
  - choose_chain's time on synthetic swarms of --servers servers over --blocks blocks (spans of about
    --span-fraction of the blocks, random round trips and speeds), the median of --repeats runs: both searches,
    without flowing steps (swarm/client/chain_search.py) and with them (flowing_routes.cheapest_flowing_chain,
    --flowing-repeats runs), the latter also with each server announcing its round trips to --links servers of
    the block after its span, as servers do (swarm/server/round_trips.py), which its pruning cannot use.
The churn harness measures the lookups themselves on a live swarm (`python -m bench.churn`: its "dht" figures,
from `live_lookups`), bench.scale on real DHT nodes holding up to thousands of simulated servers. Prints a Markdown table; exits 0.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from swarm.protocol import RemoteServer, ServerInfo, ServerState


def signed_record_bytes(blocks: int = 8) -> int:
    """One server's record under one block, as stored: its owner subkey, its value and the value's signature."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    validator = RSASignatureValidator()
    info = ServerInfo(ServerState.ONLINE, 0, blocks, 1234.5, 32768, max_session_tokens=8192)
    record = DHTRecord(key=MSGPackSerializer.dumps("SmolLM2-135M-Instruct.0"),
                       subkey=MSGPackSerializer.dumps(validator.local_public_key),
                       value=MSGPackSerializer.dumps(info.to_wire()), expiration_time=1e9)
    return len(record.subkey) + len(validator.sign_value(record))


def synthetic_swarm(servers: int, blocks: int, span_fraction: float, rng: random.Random, links: int = 0):
    """Servers with random spans (every block held), announced speeds, and measured round trips and compute; with
    `links`, each announces its round trip to that many servers holding the block after its span (0.3-1.5x the
    mean of the two servers' round trips from the client)."""
    span = max(1, round(blocks * span_fraction))
    remote, rtt, measured = [], {}, {}
    for number in range(servers):
        start = (number * span) % blocks if number * span < blocks else rng.randrange(0, blocks - span + 1)
        start = min(start, blocks - span)
        peer = f"peer{number}"
        remote.append(RemoteServer(peer, ServerInfo(ServerState.ONLINE, start, start + span, rng.uniform(50, 500), 2**20)))
        rtt[peer] = rng.uniform(0.02, 0.15)
        measured[peer] = rng.uniform(0.0005, 0.005)
    if links:
        remote = [_announcing_links(server, remote, rtt, links, rng) for server in remote]
    return remote, rtt, measured


def _announcing_links(server: RemoteServer, remote: list[RemoteServer], rtt: dict, links: int,
                      rng: random.Random) -> RemoteServer:
    following = [other.peer_id for other in remote if other.info.start <= server.info.end < other.info.end]
    chosen = rng.sample(following, min(links, len(following)))
    round_trips = tuple(sorted((peer, (rtt[server.peer_id] + rtt[peer]) / 2 * rng.uniform(0.3, 1.5))
                               for peer in chosen))
    info = server.info
    return RemoteServer(server.peer_id, ServerInfo(info.state, info.start, info.end, info.throughput,
                                                   info.cache_tokens_free, round_trips=round_trips))


def choose_chain_seconds(servers: int, blocks: int, span_fraction: float, repeats: int,
                         flowing: bool = False, links: int = 0) -> float:
    """choose_chain's median seconds on a synthetic swarm."""
    from swarm.client.routing import choose_chain

    rng = random.Random(servers * 1000 + blocks)
    remote, rtt, measured = synthetic_swarm(servers, blocks, span_fraction, rng, links)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        choose_chain(remote, blocks, "synthetic", measured=measured, rtt=rtt, flowing=flowing)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def servers_searched(servers: int, blocks: int, span_fraction: float) -> int:
    """How many of the same synthetic swarm's servers choose_chain's search keeps (the others outpriced)."""
    from swarm.client.chain_search import candidates, drop_outpriced
    from swarm.client.routing import round_trip_estimates, seconds_per_block

    remote, rtt, measured = synthetic_swarm(servers, blocks, span_fraction, random.Random(servers * 1000 + blocks))
    speed, round_trips = seconds_per_block(remote, measured), round_trip_estimates(remote, rtt)
    return len(drop_outpriced(candidates(remote, speed, round_trips, 0, blocks)))


def live_lookups(client, prefix: str, num_blocks: int, repeats: int = 5) -> dict:
    """`repeats` routing lookups (SwarmClient.servers: one DHT get of every block's key) on a live swarm: their
    seconds, and the records they brought back (each server's record once per block it holds)."""
    seconds, records = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        servers = client.servers(prefix, num_blocks)
        seconds.append(time.perf_counter() - began)
        records.append(sum(min(server.info.end, num_blocks) - server.info.start for server in servers))
    return {"lookups": repeats, "keys_per_lookup": num_blocks, "seconds_median": round(statistics.median(seconds), 4),
            "seconds_max": round(max(seconds), 4), "records_per_lookup": statistics.median(records),
            "servers_seen": len(servers)}


def main(argv=None) -> None:
    numbers = lambda text: [int(item) for item in text.split(",") if item]  # noqa: E731
    parser = argparse.ArgumentParser(prog="python -m bench.routing_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=numbers, default=[16, 100, 1000, 10000])
    parser.add_argument("--blocks", type=numbers, default=[24, 30, 80])
    parser.add_argument("--span-fraction", type=float, default=0.3, help="each server's share of the blocks (0.3)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--flowing-repeats", type=int, default=20, help="runs of the flowing search (20)")
    parser.add_argument("--links", type=int, default=16,
                        help="round trips each server announces, for the flowing search's last column (16)")
    options = parser.parse_args(argv)

    record = signed_record_bytes()
    print(f"one server's signed record under one block: {record} bytes\n")
    print("| servers | blocks | records per lookup | bytes per lookup | choose_chain ms | servers searched "
          f"| choose_chain flowing ms | flowing ms, {options.links} links announced each |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for blocks in options.blocks:
        span = max(1, round(blocks * options.span_fraction))
        for servers in options.servers:
            records = servers * span  # each server's record under each block it holds: all come back
            seconds = choose_chain_seconds(servers, blocks, options.span_fraction, options.repeats)
            searched = servers_searched(servers, blocks, options.span_fraction)
            flowing = choose_chain_seconds(servers, blocks, options.span_fraction, options.flowing_repeats, True)
            linked = choose_chain_seconds(servers, blocks, options.span_fraction, options.flowing_repeats, True,
                                          options.links)
            print(f"| {servers} | {blocks} | {records} | {records * record / 1e6:.2f} MB | {seconds * 1000:.2f} "
                  f"| {searched} | {flowing * 1000:.2f} | {linked * 1000:.1f} |")


if __name__ == "__main__":
    main()
