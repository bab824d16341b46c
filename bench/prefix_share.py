"""Sessions started from one saved prefix, sharing its cache on every server (copy-on-write forks).

    python -m bench.prefix_share [--model SmolLM2-135M-Instruct] [--prefix-tokens 512] [--forks 32]
                                 [--new-tokens 48] [--decode 16]

Starts a local swarm (the model in two halves), computes a prefix of --prefix-tokens once in a session and
parks it (a saved state), then starts --forks sessions from it (InferenceSession.fork), each adding
--new-tokens tokens of its own in one step and decoding --decode more greedily. While all of them are open,
each server's pages in use (its rpc_info) are set against the issue's target: at most 1.5x the cache of one
session of the prefix, plus the forks' own new tokens (all in pages of PAGE_TOKENS); and against what copies
would take. Fork 0's greedy tokens are checked against a fresh session's. Prints one line per server and
exits 0 whatever the verdict (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from swarm.protocol import PAGE_TOKENS


@dataclass(frozen=True)
class ShareFigures:
    peer_id: str
    pages_used: int  # on the server, with the saved prefix and every fork open
    pages_shared: int
    bound: int  # 1.5x the prefix's pages + the forks' own pages
    copies: int  # what the forks would take without sharing (the prefix copied into each)

    @property
    def verdict(self) -> str:
        return "PASS" if self.pages_used <= self.bound else "FAIL"

    def line(self) -> str:
        return (f"server {self.peer_id[-8:]}: {self.pages_used} pages in use ({self.pages_shared} shared), bound "
                f"{self.bound}, as copies {self.copies}: {self.verdict}")


def pages(tokens: int) -> int:
    return -(-tokens // PAGE_TOKENS)


def bound_pages(prefix_tokens: int, forks: int, own_tokens: int) -> int:
    """The target: 1.5x one session of the prefix, plus each fork's own tokens (from the prefix's end on)."""
    own = pages(prefix_tokens + own_tokens) - pages(prefix_tokens) + (1 if prefix_tokens % PAGE_TOKENS else 0)
    return int(1.5 * pages(prefix_tokens)) + forks * own


def prefix_ids(model, tokens: int) -> list[int]:
    """A system prompt and tool preamble's worth of real text, `tokens` long."""
    text = ("You are a helpful assistant. You can call these tools: search(query), calculator(expression), "
            "weather(city), calendar(date). Answer briefly and cite your sources. ")
    ids = model.tokenizer.encode(text)
    return (ids * (tokens // len(ids) + 1))[:tokens]


def measure(model, peer_ids: list[str], prefix_tokens: int, forks: int, new_tokens: int, decode: int
            ) -> tuple[list[ShareFigures], bool]:
    """Fork `forks` sessions from a saved prefix on `model`'s swarm (servers `peer_ids`); the figures of each
    server with all of them open, and whether fork 0 decoded what a fresh session does."""
    prefix = prefix_ids(model, prefix_tokens)
    length = prefix_tokens + new_tokens + decode + 1
    saved = model.session(max_length=length)
    sessions, tokens = [], []
    try:
        saved.step([prefix])
        saved.park()
        for index in range(forks):
            forked = saved.fork(prefix_tokens)
            sessions.append(forked)
            tokens.append(greedy(forked, [(index * 7 + offset) % 200 + 10 for offset in range(new_tokens)], decode))
        infos = [model.client.server_info(peer_id) for peer_id in peer_ids]
    finally:
        for session in [saved, *sessions]:
            session.close()
    with model.session(max_length=length) as fresh:
        fresh_tokens = greedy(fresh, prefix + [offset % 200 + 10 for offset in range(new_tokens)], decode)
    own = new_tokens + decode
    copies = forks * pages(prefix_tokens + own) + pages(prefix_tokens)
    figures = [ShareFigures(peer_id, info["cache_pages_used"], info["cache_pages_shared"],
                            bound_pages(prefix_tokens, forks, own), copies) for peer_id, info in zip(peer_ids, infos)]
    return figures, tokens[0] == fresh_tokens if tokens else True


def greedy(session, ids: list[int], tokens: int) -> list[int]:
    logits, chosen = session.step([ids]), []
    for _ in range(tokens):
        chosen.append(int(logits[0].argmax()))
        logits = session.step([[chosen[-1]]])
    return chosen


def main(argv=None) -> None:
    from config import SwarmSettings
    from swarm.client.remote_model import RemoteModel
    from swarm.local import LocalSwarm, halves
    from swarm.weights import load_config, resolve_model

    parser = argparse.ArgumentParser(prog="python -m bench.prefix_share", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--forks", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens each fork adds in one step")
    parser.add_argument("--decode", type=int, default=16, help="tokens each fork then decodes greedily")
    options = parser.parse_args(argv)
    cache_dir = SwarmSettings.from_env().cache_dir
    blocks = load_config(resolve_model(options.model, cache_dir)).num_hidden_layers
    with LocalSwarm(options.model, halves(blocks)) as swarm:
        model = RemoteModel.from_pretrained(options.model, swarm.initial_peers, cache_dir)
        try:
            figures, same = measure(model, [server.peer_id for server in swarm.servers], options.prefix_tokens,
                                    options.forks, options.new_tokens, options.decode)
        finally:
            model.close()
    print(f"{options.forks} sessions forked from one saved {options.prefix_tokens}-token prefix, each adding "
          f"{options.new_tokens} + {options.decode} tokens (pages of {PAGE_TOKENS} tokens):")
    for figure in figures:
        print("  " + figure.line())
    print(f"  fork 0's greedy tokens {'equal' if same else 'DIFFER FROM'} a fresh session's")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
