"""`python -m bench.fairness`: one client's many sessions beside another client's one (issue 39's audit case).

    python -m bench.fairness [--shape default] [--many 16] [--tokens 32] [--bounds 0,8]

Two block servers and a real gunicorn gateway with two API keys: client A opens `--many` WebSocket sessions and
client B one, and all generate `--tokens` tokens at once (greedy). For each ENGINE_MAX_STEPS in `--bounds` (0: none; see
gateway/engine/turns.py), it prints A's aggregate tok/s, B's time per token and its share of the tokens generated while both ran, and the same for B
alone first (its time per token with the loop to itself).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from bench.clients import websocket_reply
from bench.gateway import Gateway
from bench.workload import chat_prompt, session_length

KEYS = ("client-a-key", "client-b-key")


def main(argv=None) -> None:
    options = parse(argv)
    for bound in options.bounds:
        print(f"ENGINE_MAX_STEPS={bound}: {run(options, bound)}", flush=True)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.fairness", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="default", help="a shape of bench/shapes.py, or 'default'")
    parser.add_argument("--many", type=int, default=16, help="client A's sessions")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--bounds", default="0,8", type=lambda text: [int(n) for n in text.split(",")])
    parser.add_argument("--timeout", type=float, default=600.0)
    return parser.parse_args(argv)


def run(options: argparse.Namespace, bound: int) -> dict:
    from bench.shapes import model_folder
    from config import SwarmSettings
    from swarm.local import LocalSwarm, halves
    from swarm.weights import load_config, load_tokenizer

    shape = None if options.shape == "default" else options.shape
    name, folder = model_folder(shape, "float32", SwarmSettings.from_env().cache_dir, "cpu")
    source = str(folder) if shape is not None else name
    prompt = chat_prompt(load_tokenizer(folder))
    cache_tokens = (options.many + 3) * session_length(prompt, options.tokens) * 2
    log_dir = Path(tempfile.mkdtemp(prefix="bench-fairness-"))
    env = {"API_KEYS": ",".join(KEYS), "ENGINE_MAX_STEPS": str(bound), "REQUESTS_PER_MINUTE": "0"}
    with ExitStack() as running:
        swarm = running.enter_context(LocalSwarm(source, halves(load_config(folder).num_hidden_layers),
                                                 server_args=["--cache-tokens", str(cache_tokens)], log_dir=log_dir))
        gateway = running.enter_context(Gateway(swarm.initial_peers, options.many + 4, 1, log_dir, source, env=env))
        url_of = {key: f"{gateway.ws_url}?api_key={key}" for key in KEYS}
        reply = lambda key: websocket_reply(url_of[key], prompt, options.tokens,  # noqa: E731
                                            time.perf_counter() + options.timeout)
        reply(KEYS[1])  # warm-up: loads the model
        alone = reply(KEYS[1])
        with ThreadPoolExecutor(options.many + 1) as pool:
            many = [pool.submit(reply, KEYS[0]) for _ in range(options.many)]
            one = pool.submit(reply, KEYS[1]).result()
            many = [future.result() for future in many]
    return summary(alone, one, many)


def summary(alone, one, many) -> dict:
    """B's ms per token alone and beside A; A's tok/s; B's share of the tokens made while B generated."""
    def ms_per_token(stream) -> float:
        return round((stream.arrivals[-1] - stream.arrivals[0]) * 1000 / max(len(stream.arrivals) - 1, 1), 1)

    start, end = one.arrivals[0], one.arrivals[-1]
    a_tokens = sum(start <= arrival <= end for stream in many for arrival in stream.arrivals)
    a_wall = max(stream.arrivals[-1] for stream in many) - min(stream.arrivals[0] for stream in many)
    return {"b_alone_ms_per_token": ms_per_token(alone), "b_beside_a_ms_per_token": ms_per_token(one),
            "a_tok_s": round(sum(len(stream.arrivals) for stream in many) / a_wall, 1),
            "b_share_while_b_ran": round(len(one.arrivals) / max(len(one.arrivals) + a_tokens, 1), 3)}


if __name__ == "__main__":
    main()
