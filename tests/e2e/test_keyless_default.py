"""Where a gateway without API keys listens decides whether its callers are one trusted user (gunicorn.conf.py):
on loopback only (`make run`, a laptop), the machine's owner gets prefix reuse and the stateful routes, as vLLM and
llama.cpp give them; on any other address, strangers may share one, so those are off and a line at start says so;
an explicit KEYLESS_SHARING wins either way. Real gunicorn, the official openai client."""

import json

import openai
import pytest
import requests

from gunicorn_gateway import running_gateway
from shared_swarm import TINY_PREFIX

SYSTEM = {"role": "system", "content": "You are a careful assistant who answers every question in one sentence."}


@pytest.fixture(scope="module")
def env(tiny_swarm, tiny_llama):
    models = [{"name": "tiny", "path": str(tiny_llama), "dht_prefix": TINY_PREFIX, "max_session_length": 1024}]
    return {"INITIAL_PEERS": " ".join(tiny_swarm.initial_peers), "MODELS": json.dumps(models), "MAX_NEW_TOKENS": "16"}


def four_turns(gateway) -> list[int]:
    """A 4-turn chat as a new user would send it (no cache_salt): each turn's cached_tokens."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    messages, cached = [SYSTEM], []
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question number {turn}: what comes next in the sequence?"})
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return cached


def stateful_route(gateway) -> int:
    """The status of MLC's stateful chat (what KEYLESS_SHARING guards), asked of the gateway."""
    return requests.get(gateway.url + "/v1/states", timeout=30).status_code


def test_on_loopback_without_keys_the_owner_reuses_prefixes_and_keeps_state(env, tmp_path):
    with running_gateway(env, tmp_path) as gateway:
        cached = four_turns(gateway)
        assert cached[0] == 0 and all(tokens > 0 for tokens in cached[1:]), cached
        assert stateful_route(gateway) == 200
        assert "KEYLESS_SHARING" not in gateway.log()


def test_beyond_loopback_without_keys_nothing_is_shared_and_a_line_says_so(env, tmp_path):
    with running_gateway(env, tmp_path, host="0.0.0.0") as gateway:
        assert four_turns(gateway) == [0, 0, 0, 0]
        assert stateful_route(gateway) == 403
        line = next(line for line in gateway.log().splitlines() if "without API keys" in line)
        assert "0.0.0.0" in line and "API_KEYS" in line and "KEYLESS_SHARING=1" in line


def test_an_explicit_keyless_sharing_wins_on_loopback_too(env, tmp_path):
    """(KEYLESS_SHARING=1 beyond loopback, and every other case of the decision: tests/unit/test_keyless_identity.py)"""
    with running_gateway({**env, "KEYLESS_SHARING": "0"}, tmp_path) as gateway:
        assert stateful_route(gateway) == 403
        assert "without API keys" not in gateway.log()
