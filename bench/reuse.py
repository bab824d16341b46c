"""`python -m bench.reuse`: conversations kept on the servers (gateway/engine/warm.py), against recomputing them.

    python -m bench.reuse [--turns 10] [--tokens 32] [--preamble-tokens 3000] [--threads 1]

The default model on two block servers (its blocks in halves) and two gateways in front of them, one keeping
conversations warm (the default) and one not (WARM_SESSIONS=0); each runs the same two workloads, greedily,
with the official openai client streaming:
  1. a chat of --turns turns, sending the whole history each time: every turn's time to first token, and the
     cached_tokens its usage reports; the replies of both gateways must be identical;
  2. an Open WebUI-like chat: a first message behind a --preamble-tokens tool preamble (a system prompt), then a
     second message of the same chat: the second's time to first token against the first's.
Prints the figures and the issue's targets (PASS or FAIL); exits 0 whatever they are: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.gateway import Gateway
from bench.workload import FILLER, MODEL
from swarm.protocol import PAGE_TOKENS

QUESTIONS = ["Tell me about the sea.", "Why is it salty?", "How deep is it?", "What lives at the bottom?",
             "Is it cold there?", "How do fish breathe?", "Do whales sleep?", "What is a coral reef?",
             "Why are reefs in danger?", "What can people do?", "Summarize our chat.", "Thank you!"]
# the benchmark is one user of a gateway without keys: its requests may continue each other's conversations
ONE_USER = {"KEYLESS_SHARING": "1"}


@dataclass
class Turn:
    ttft: float  # seconds from sending the request to the first token with text
    prompt_tokens: int
    cached_tokens: int
    text: str


@dataclass
class Chat:
    turns: list[Turn] = field(default_factory=list)


def ask(base_url: str, messages: list[dict], tokens: int) -> Turn:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    sent, first, pieces, usage = time.perf_counter(), None, [], None
    try:
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=tokens, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                pieces.append(chunk.choices[0].delta.content)
    finally:
        client.close()
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Turn((first or time.perf_counter()) - sent, usage.prompt_tokens, cached, "".join(pieces))


def multi_turn(base_url: str, turns: int, tokens: int) -> Chat:
    chat, messages = Chat(), [{"role": "system", "content": "You are a helpful assistant."}]
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        turn = ask(base_url, messages, tokens)
        chat.turns.append(turn)
        messages.append({"role": "assistant", "content": turn.text})
    return chat


def preamble_chat(base_url: str, preamble_tokens: int, tokens: int) -> Chat:
    """A long system prompt (as Open WebUI's tool definitions), then two messages of one chat."""
    preamble = "You can call these tools. " + FILLER * (preamble_tokens // 40)
    chat, messages = Chat(), [{"role": "system", "content": preamble}]
    for question in ("What tools do you have?", "Use the first one."):
        messages.append({"role": "user", "content": question})
        turn = ask(base_url, messages, tokens)
        chat.turns.append(turn)
        messages.append({"role": "assistant", "content": turn.text})
    return chat


def report(name: str, chat: Chat) -> None:
    print(f"\n{name}")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT s':>8}")
    for number, turn in enumerate(chat.turns, 1):
        print(f"{number:>4} {turn.prompt_tokens:>7} {turn.cached_tokens:>7} {turn.ttft:>8.3f}")


def verdict(label: str, passed: bool, figure: str) -> None:
    print(f"{'PASS' if passed else 'FAIL'}  {label}: {figure}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.reuse", description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per reply")
    parser.add_argument("--preamble-tokens", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each process")
    options = parser.parse_args(argv)

    from config import SwarmSettings
    from swarm.local import LocalSwarm, halves
    from swarm.weights import load_config, resolve_model

    log_dir = Path(tempfile.mkdtemp(prefix="bench-reuse-"))
    spans = halves(load_config(resolve_model(MODEL, SwarmSettings.from_env().cache_dir)).num_hidden_layers)
    for name in ("warm", "cold"):
        (log_dir / name).mkdir()
    print(f"starting block servers {spans} and two gateways; logs in {log_dir}")
    with LocalSwarm(MODEL, spans, server_args=["--threads", str(options.threads)], log_dir=log_dir) as swarm, \
            Gateway(swarm.initial_peers, 8, options.threads, log_dir / "warm", env=ONE_USER) as warm, \
            Gateway(swarm.initial_peers, 8, options.threads, log_dir / "cold", env={"WARM_SESSIONS": "0"}) as cold:
        kept, recomputed = multi_turn(warm.openai_url, options.turns, options.tokens), \
            multi_turn(cold.openai_url, options.turns, options.tokens)
        report("multi-turn chat, conversations kept warm", kept)
        report("multi-turn chat, recomputed (WARM_SESSIONS=0)", recomputed)
        long_kept = preamble_chat(warm.openai_url, options.preamble_tokens, options.tokens)
        long_recomputed = preamble_chat(cold.openai_url, options.preamble_tokens, options.tokens)
        report(f"{options.preamble_tokens}-token preamble, kept warm", long_kept)
        report(f"{options.preamble_tokens}-token preamble, recomputed", long_recomputed)

    print()
    first, last = kept.turns[0], kept.turns[-1]
    verdict(f"turn {len(kept.turns)}'s TTFT <= 1.3x turn 1's", last.ttft <= 1.3 * first.ttft,
            f"{last.ttft:.3f} s vs {first.ttft:.3f} s ({last.ttft / first.ttft:.2f}x; recomputed: "
            f"{recomputed.turns[-1].ttft / recomputed.turns[0].ttft:.2f}x)")
    earlier = [turn.prompt_tokens for turn in kept.turns[:-1]]
    shortfall = max(earlier[index] + options.tokens - turn.cached_tokens for index, turn in enumerate(kept.turns[1:]))
    # all but the reply's last token (never sent), and whatever the cut to whole pages leaves out
    verdict("cached_tokens from turn 2 on cover the earlier turns", shortfall <= 1 + PAGE_TOKENS,
            f"at most {shortfall} tokens of an earlier turn (prompt and reply) not reused")
    same = [a.text for a in kept.turns] == [b.text for b in recomputed.turns] and \
        [a.text for a in long_kept.turns] == [b.text for b in long_recomputed.turns]
    verdict("greedy replies identical with and without reuse", same, "identical" if same else "DIFFERENT")
    second, opening = long_kept.turns[1], long_kept.turns[0]
    verdict("the preamble chat's second TTFT <= 0.2x its first", second.ttft <= 0.2 * opening.ttft,
            f"{second.ttft:.3f} s vs {opening.ttft:.3f} s ({second.ttft / opening.ttft:.2f}x; recomputed: "
            f"{long_recomputed.turns[1].ttft / long_recomputed.turns[0].ttft:.2f}x)")


if __name__ == "__main__":
    main()
