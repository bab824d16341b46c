"""`python -m bench.gateway_capacity`: what the gateway alone delivers and costs, its chain answering at once.

    python -m bench.gateway_capacity [--clients 64,256] [--tokens 64] [--apis ws,sse]

A real gunicorn gateway (gunicorn.conf.py, as `make run` starts it) serving bench.instant_swarm:app: the tiny
test model's tokenizer, embeddings and LM head, over a swarm that hands every step's outputs back at once (see
bench/instant_swarm.py). For each API (`ws`: Petals WebSocket sessions, one token per frame; `sse`: streamed
OpenAI chat completions through the official client) and each number of simultaneous streaming clients, it
prints the tokens per second delivered to all of them, the worker process's CPU per delivered token, and the
median time to first token. The clients run in this process, on the same cores: on a machine of few cores the
figures are the gateway's CPU per token first, its capacity second.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.clients import openai_reply
from bench.engine import _children, _cpu
from bench.gateway import Gateway
from bench.load import concurrent_replies
from bench.stats import summarize_concurrent
from bench.workload import chat_prompt

# the gateway joins no swarm (its models' steps are answered in process), but a peer keeps gunicorn.conf.py from
# starting an embedded local swarm
NO_SWARM = ["/ip4/127.0.0.1/tcp/9/p2p/QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"]


def main(argv=None) -> None:
    options = parse(argv)
    for line in run(options):
        print(line, flush=True)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_capacity", description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default=[64, 256], type=lambda text: [int(n) for n in text.split(",")])
    parser.add_argument("--tokens", type=int, default=64, help="tokens a reply (all of them: no stop token)")
    parser.add_argument("--apis", default=["ws", "sse"], type=lambda text: text.split(","))
    parser.add_argument("--timeout", type=float, default=300.0)
    return parser.parse_args(argv)


def run(options: argparse.Namespace):
    """Yields the table's lines as each run ends."""
    from bench.shapes import model_folder
    from config import SwarmSettings
    from swarm.weights import load_tokenizer

    _, folder = model_folder("tiny", "float32", SwarmSettings.from_env().cache_dir, "cpu")
    name = folder.name  # what a model given by its folder is served as
    prompt = chat_prompt(load_tokenizer(folder))
    most = max(options.clients)
    env = {"MAX_NEW_TOKENS": str(options.tokens), "WARM_SESSIONS": "0", "SPECULATIVE_TOKENS": "0"}
    with Gateway(NO_SWARM, most + 8, 1, Path(tempfile.mkdtemp(prefix="bench-capacity-")), str(folder), env=env,
                 app="bench.instant_swarm:app") as gateway:
        worker = _children(gateway.process.process.pid)[0]
        replies(gateway, name, prompt, "ws", 4, options)  # warm-up: the model loads on the first request
        yield f"{'api':<5} {'clients':>8} {'tok/s':>9} {'worker CPU ms/tok':>18} {'TTFT ms p50':>12} {'errors':>7}"
        for api in options.apis:
            for clients in options.clients:
                before = _cpu(worker)
                summary = summarize_concurrent(replies(gateway, name, prompt, api, clients, options))
                tokens = max(summary["tokens"], 1)
                cpu = (_cpu(worker) - before) * 1000 / tokens
                yield (f"{api:<5} {clients:>8} {summary['aggregate_tok_s']:>9.0f} {cpu:>18.3f} "
                       f"{summary['ttft_p50_s'] * 1000:>12.1f} {len(summary['errors']):>7}")
                gateway.wait_idle()


def replies(gateway: Gateway, model: str, prompt, api: str, clients: int, options: argparse.Namespace) -> list:
    if api == "ws":
        return concurrent_replies(gateway.ws_url, prompt, options.tokens, clients, options.timeout)
    deadline = time.perf_counter() + options.timeout
    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(openai_reply, gateway.openai_url, model, prompt, options.tokens, deadline)
                   for _ in range(clients)]
        return [future.result() for future in futures]


if __name__ == "__main__":
    main()
