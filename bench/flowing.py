"""`python -m bench.flowing`: one session's decode speed through chains of 2, 4 and 8 hops across a simulated
WAN whose every link has the same round trip, with flowing steps and with relayed ones.

    python -m bench.flowing [--hops 2,4,8] [--link-ms 50] [--tokens 24] [--trials 2] [--json PATH]

The tiny-8 shape (bench/shapes.py: eight tiny blocks, random weights) on N block servers of 8/N blocks each,
all in one region of a network map (swarm/network_map.py) whose round trip is --link-ms: a client-to-server
link and a server-to-server link cost the same, and a push crosses its link once. A step's network time is then
N x link relayed (each server's round trip from the client), and (N + 1) x link / 2 flowing (in to the first,
along each link, out from the last): the "floor" columns. Greedy tokens after a 3-token prompt, flowing and
relayed alternating; the outputs of both must be identical. Prints a Markdown table, writes JSON (--json,
default bench/results/flowing-<time>.json); exits 0 whatever the figures: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

PROMPT = [5, 17, 42]
# plain decoding relayed and flowing, then speculative (prompt lookup on a copy-heavy prompt) relayed and flowing
WAYS = ("relayed", "flowing", "speculative relayed", "speculative flowing")
BLOCKS = 8  # the tiny-8 shape's


def link_map(link_ms: float) -> str:
    """A network map of one region, every link (client to server, server to server) `link_ms` round trip."""
    return json.dumps({"round_trip_ms": [["net", "net", link_ms]], "default_region": "net"})


def spans(hops: int, blocks: int = BLOCKS) -> list[tuple[int, int]]:
    """`hops` spans of equal length covering the blocks."""
    if hops < 1 or blocks % hops:
        raise ValueError(f"--hops: {hops} does not divide the {blocks} blocks")
    size = blocks // hops
    return [(start, start + size) for start in range(0, blocks, size)]


def floors(hops: int, link_ms: float) -> dict[str, float]:
    """Seconds of network per step: relayed, each hop a round trip; flowing, half a link in, along and out."""
    return {"relayed": hops * link_ms / 1000, "flowing": (hops + 1) * link_ms / 2000}


def decode(remote, flowing: bool, tokens: int, prompt: list[int] = PROMPT) -> tuple[list[int], float, int]:
    """Greedy tokens of one session, its decode tokens/s, and the pushes it missed."""
    with remote.session(max_length=len(prompt) + tokens + 1) as session:
        session.blocks.flowing = flowing
        logits = session.step([prompt])
        generated, began = [], time.perf_counter()
        for _ in range(tokens):
            generated.append(int(logits[0].argmax()))
            logits = session.step([[generated[-1]]])
        return generated, tokens / (time.perf_counter() - began), session.blocks.pushes_missed


def decode_speculative(remote, flowing: bool, prompt: list[int], tokens: int, most: int = 4) -> tuple[list[int], float]:
    """Greedy tokens as the gateway speculates them: each step carries the next token and up to `most` prompt-lookup
    guesses (gateway/engine/speculation.py), verified at once, the longest agreeing prefix kept and the rest
    rewound by the next step; its tokens and decode tokens/s."""
    from gateway.engine.speculation import prompt_lookup

    with remote.session(max_length=len(prompt) + tokens + most + 1) as session:
        session.blocks.flowing = flowing
        following = int(session.step([prompt])[0].argmax())
        context, generated, began = list(prompt), [], time.perf_counter()
        while len(generated) < tokens:
            generated.append(following)
            context.append(following)
            draft = prompt_lookup(context, min(most, tokens - len(generated)))
            choices = session.step([[following, *draft]], position=len(context) - 1, every_position=True)[0]
            choices = choices.argmax(-1).tolist()
            kept = next((index for index, token in enumerate(draft) if token != choices[index]), len(draft))
            generated += draft[:kept]
            context += draft[:kept]
            following = choices[kept]
        return generated[:tokens], tokens / (time.perf_counter() - began)


def measure(hops: int, folder: Path, options, log_dir: Path) -> dict:
    """A fresh swarm of `hops` servers on one map; the best of --trials runs of each way."""
    from swarm.client import SwarmClient
    from swarm.client.remote_model import RemoteModel
    from swarm.local import LocalSwarm, network_map_args

    prefix = f"flowing-bench-{hops}"
    server_args = ["--dht-prefix", prefix, "--threads", "1", *network_map_args(link_map(options.link_ms), "net")]
    (log_dir / str(hops)).mkdir(parents=True)
    with LocalSwarm(str(folder), spans(hops), server_args=server_args, log_dir=log_dir / str(hops)) as swarm:
        remote = RemoteModel(folder, SwarmClient(swarm.initial_peers), "tiny-8", prefix)
        try:
            rates, outputs, missed = {way: [] for way in WAYS}, {}, 0
            for _ in range(options.trials):
                for way in WAYS:
                    flowing = way.endswith("flowing")
                    if way.startswith("speculative"):  # copy-heavy: the prompt holds what the model will say
                        tokens, rate = decode_speculative(remote, flowing, PROMPT + outputs["relayed"],
                                                          options.tokens)
                        tokens = PROMPT + outputs["relayed"] + tokens  # compared with a plain decode of the same
                    else:
                        tokens, rate, lost = decode(remote, flowing, options.tokens)
                        missed += lost if flowing else 0
                    rates[way].append(rate)
                    outputs.setdefault(way, tokens)
            copy_heavy = PROMPT + outputs["relayed"]
            copied = copy_heavy + decode(remote, False, options.tokens, copy_heavy)[0]  # what speculation must equal
        finally:
            remote.close()
    return {"hops": hops, "link_ms": options.link_ms, "floor_s": floors(hops, options.link_ms),
            **{f"{way}_tok_s": max(rates[way]) for way in WAYS}, "pushes_missed": missed,
            "identical": outputs["relayed"] == outputs["flowing"]
            and outputs["speculative relayed"] == outputs["speculative flowing"] == copied}



def table(results: list[dict]) -> str:
    lines = ["| hops | link ms | relayed tok/s | flowing tok/s | speed-up | speculative relayed / flowing tok/s "
             "| speed-up | network floor relayed / flowing ms | outputs identical | pushes missed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        floor, plain = result["floor_s"], result["flowing_tok_s"] / result["relayed_tok_s"]
        speculative = result["speculative flowing_tok_s"] / result["speculative relayed_tok_s"]
        lines.append(f"| {result['hops']} | {result['link_ms']:g} | {result['relayed_tok_s']:.2f} | "
                     f"{result['flowing_tok_s']:.2f} | {plain:.2f}x | {result['speculative relayed_tok_s']:.2f} / "
                     f"{result['speculative flowing_tok_s']:.2f} | {speculative:.2f}x | "
                     f"{floor['relayed'] * 1000:.0f} / {floor['flowing'] * 1000:.0f} | "
                     f"{'yes' if result['identical'] else 'NO'} | {result['pushes_missed']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from config import SwarmSettings
    from bench.shapes import shape_folder

    parser = argparse.ArgumentParser(prog="python -m bench.flowing", description=__doc__.splitlines()[0])
    parser.add_argument("--hops", default="2,4,8", help="chain lengths, each dividing 8 (default 2,4,8)")
    parser.add_argument("--link-ms", type=float, default=50.0, help="every link's round trip (default 50)")
    parser.add_argument("--tokens", type=int, default=24, help="decode tokens per session (default 24)")
    parser.add_argument("--trials", type=int, default=2, help="sessions each way per chain; the best counts")
    parser.add_argument("--json", type=Path, help="where to write the results (default bench/results/...)")
    options = parser.parse_args(argv)
    hops = [int(item) for item in options.hops.split(",")]
    for count in hops:
        spans(count)  # a wrong --hops fails before any server starts
    folder = shape_folder("tiny-8", "float32", SwarmSettings.from_env().cache_dir)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-flowing-"))
    results = []
    for count in hops:
        print(f"{count} hops, {options.link_ms:g} ms links ...", flush=True)
        results.append(measure(count, folder, options, log_dir))
    print(table(results))
    path = options.json or Path("bench/results") / f"flowing-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"results: {path}; server logs: {log_dir}")


if __name__ == "__main__":
    main()
