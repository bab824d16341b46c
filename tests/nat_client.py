"""A swarm client run as its own process (in a network namespace: tests/netns.py), for test_nat_relay.py.

    python tests/nat_client.py --model FOLDER --prefix PREFIX --initial-peers MADDR... --prompt ID... --tokens N
        [--turns AVOID...] [--sessions K]

Greedily decodes N tokens after the prompt in each of K sessions, one after another, and prints one JSON line:
the tokens, each session's chain (peer ids), its decode steps' seconds (the first step, the prompt, left out),
whether each server's record says it is relayed, (--pings N) the median round trip of an info request to each, and the steps pushed to each by the server before it. `--turns`: session i avoids the servers of turns[i % len(turns)], a comma-separated list of peer ids ("-": none), so
that configurations take turns on a machine whose other load changes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project, imported from the repository root


def avoiding(client, avoided: set) -> None:
    """Every chain the client picks leaves out the peers in `avoided` at the time."""
    choose = client.chain

    def chain(*args, exclude=(), **routing):
        return choose(*args, exclude={*exclude, *avoided}, **routing)

    client.chain = chain


def decode(model, prompt: list[int], tokens: int) -> dict:
    """One session: the prompt, then `tokens` greedy steps, each timed."""
    session = model.session(max_length=len(prompt) + tokens)
    try:
        sequence, steps = list(prompt), []
        logits = session.step([prompt])
        for _ in range(tokens):
            sequence.append(int(logits[0].argmax()))
            started = time.perf_counter()
            logits = session.step([[sequence[-1]]])
            steps.append(time.perf_counter() - started)
        chain = [hop.link.peer_id for hop in session.blocks.hops]
    finally:
        session.close()
    return {"tokens": sequence[len(prompt):], "chain": chain, "step_seconds": steps}


def ping_medians(client, peers, rounds: int) -> dict:
    """Median seconds of an info request to each of `peers`, asked in turns `rounds` times: a round trip through
    the network and the server's event loop, without compute. The client's routing counts each one, as its own
    probes would over a while (PeerLoad.round_trip keeps the least of the last few)."""
    from swarm.client.stubs import call_info

    async def timed(peer):
        began = time.perf_counter()
        await call_info(client.node.p2p, peer, timeout=10.0)
        return time.perf_counter() - began

    times = {peer: [] for peer in peers}
    for _ in range(rounds):
        for peer in peers:
            times[peer].append(client.loop.run(timed(peer)))
            client.load.round_trip(peer, times[peer][-1])
    return {peer: statistics.median(seconds) for peer, seconds in times.items() if seconds}


def main() -> None:
    from swarm.client.remote_model import RemoteModel

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--prompt", nargs="+", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--pings", type=int, default=0, help="time this many info requests to each server")
    parser.add_argument("--turns", nargs="+", default=["-"])
    parser.add_argument("--cache-dir", default="/tmp/nat-client-cache")
    args = parser.parse_args()
    model = RemoteModel.from_pretrained(args.model, args.initial_peers, Path(args.cache_dir), args.prefix,
                                        block_wait=60.0)
    try:
        avoided: set = set()
        avoiding(model.client, avoided)
        if args.pings:  # routing prices links measured a few times, not one first probe of a busy machine
            ping_medians(model.client, [server.peer_id for server in model.client.servers(args.prefix,
                                                                                          model.num_blocks)], 6)
        sessions = []
        for index in range(args.sessions):
            turn = args.turns[index % len(args.turns)]
            avoided.clear()
            avoided.update(peer for peer in turn.split(",") if peer and peer != "-")
            sessions.append(decode(model, args.prompt, args.tokens))
        servers = model.client.servers(args.prefix, model.num_blocks)
        relayed = {server.peer_id: server.info.relayed for server in servers}
        pings = ping_medians(model.client, sorted(relayed), args.pings) if args.pings else {}
        # steps whose inputs the previous server pushed to it (server to server, not through this client)
        pushed = {peer: model.client.server_info(peer).get("steps_pushed") for peer in relayed}
    finally:
        model.close()
    print(json.dumps({"sessions": sessions, "relayed": relayed, "pings": pings, "pushed": pushed}), flush=True)


if __name__ == "__main__":
    main()
