"""`python -m swarm.client.generate`: an operator's quick check that a swarm works; streams an answer as it comes.

    python -m swarm.client.generate --initial-peers MADDR --model SmolLM2-135M-Instruct --prompt "Hi!" --chat

Greedy unless --temperature is given. The text goes to stdout; a one-line speed summary goes to stderr.
torch and the client load only once the flags are checked, so a wrong flag is told at once.
"""

from __future__ import annotations

import sys
import time
from typing import Iterator


def prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        messages = [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    return tokenizer(prompt)["input_ids"]


def generate(model, ids: list[int], max_new_tokens: int, temperature=0.0, top_k=0, top_p=1.0, seed=None) -> Iterator[int]:
    """Yield new token ids one by one until a stop token (the model's stop_token_ids, as the gateway's engine
    stops) or max_new_tokens."""
    import torch

    from swarm.client.decoding import next_token

    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    stops = model.stop_token_ids
    with model.session(max_length=len(ids) + max_new_tokens) as session:
        logits = session.step([ids])
        for _ in range(max_new_tokens):
            token = int(next_token(logits, temperature, top_k, top_p, generator)[0])
            if token in stops:
                return
            yield token
            logits = session.step([[token]])


def run(args) -> None:
    import torch

    from swarm.client.decoding import IncrementalDetokenizer
    from swarm.client.remote_model import RemoteModel

    model = RemoteModel.from_pretrained(args.model, args.initial_peers, args.cache_dir, args.dht_prefix,
                                        wire_dtype=getattr(torch, args.wire_dtype),
                                        allowed_servers=args.allowed_servers, spot_check_rate=args.spot_check_rate)
    try:
        ids = prompt_ids(model.tokenizer, args.prompt, args.chat)
        detokenizer = IncrementalDetokenizer(model.tokenizer)
        began, count = time.perf_counter(), 0
        for token in generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed):
            count += 1
            sys.stdout.write(detokenizer.push(token))
            sys.stdout.flush()
        seconds = time.perf_counter() - began
        print(flush=True)
        print(f"{count} tokens in {seconds:.2f} s ({count / seconds:.2f} tokens/s)", file=sys.stderr, flush=True)
    finally:
        model.close()


def main(argv=None) -> None:
    from config import WIRE_DTYPES
    from swarm.cli import ArgumentParser, multiaddr, run_main, settings_from_env, setup_logging

    settings = settings_from_env()
    parser = ArgumentParser(prog="python -m swarm.client.generate", description="Generate text through a swarm.")
    parser.add_argument("--initial-peers", nargs="*", type=multiaddr, default=list(settings.initial_peers))
    parser.add_argument("--model", default=settings.model, help="a known model name or a Hugging Face folder")
    parser.add_argument("--dht-prefix", help="the model's name in the DHT (default: from --model)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--wire-dtype", choices=WIRE_DTYPES, default=settings.wire_dtype,
                        help="how hidden states travel to servers (16-bit halves the bytes; float32 is exact)")
    args = parser.parse_args(argv)
    if not args.initial_peers:
        parser.error("--initial-peers is required (or set INITIAL_PEERS)")
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        parser.error("--temperature must be >= 0, --top-p in (0, 1], --top-k >= 0")
    args.cache_dir = settings.cache_dir
    args.allowed_servers, args.spot_check_rate = settings.allowed_servers, settings.spot_check_rate
    setup_logging()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    run_main(lambda: run(args))


if __name__ == "__main__":
    main()
