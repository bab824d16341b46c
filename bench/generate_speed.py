"""Tokens per second of greedy generation: the swarm (two servers, blocks 0:15 and 15:30) beside transformers'
own `generate` in one process, with the same thread settings. Runs alternate, and medians are reported,
because this machine is noisy.

    .venv/bin/python bench/generate_speed.py [--tokens 128] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "Write a short story about a robot who learns to paint."
MODEL = "SmolLM2-135M-Instruct"


def main() -> None:
    import torch
    import transformers

    from config import SwarmSettings
    from swarm.generate import generate, prompt_ids
    from swarm.local import LocalSwarm
    from swarm.model import RemoteModel
    from swarm.weights import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every process")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = SwarmSettings.from_env()
    folder = resolve_model(MODEL, settings.cache_dir)

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    local = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = prompt_ids(tokenizer, PROMPT, chat=True)
    print(f"prompt: {len(ids)} tokens; {args.tokens} new tokens; {args.threads} torch thread(s) per process")

    def run_local() -> float:
        began = time.perf_counter()
        with torch.no_grad():
            out = local.generate(torch.tensor([ids]), max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
        return (out.shape[1] - len(ids)) / (time.perf_counter() - began)

    server_args = ["--threads", str(args.threads)]
    with LocalSwarm(MODEL, [(0, 15), (15, 30)], server_args=server_args) as swarm:
        remote = RemoteModel.from_pretrained(MODEL, swarm.initial_peers, settings.cache_dir)

        def run_swarm() -> float:
            began = time.perf_counter()
            count = sum(1 for _ in generate(remote, ids, args.tokens))
            return count / (time.perf_counter() - began)

        run_swarm(), run_local()  # warm-up
        local_speeds, swarm_speeds = [], []
        for _ in range(args.rounds):
            local_speeds.append(run_local())
            swarm_speeds.append(run_swarm())
        remote.close()

    for name, speeds in (("transformers generate (local)", local_speeds), ("swarm, 2 servers", swarm_speeds)):
        runs = ", ".join(f"{speed:.1f}" for speed in speeds)
        print(f"{name:32s} median {statistics.median(speeds):6.2f} tok/s   runs: {runs}")
    print(f"swarm / local: {statistics.median(swarm_speeds) / statistics.median(local_speeds):.2f}x")


if __name__ == "__main__":
    main()
