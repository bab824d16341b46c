"""bench/instant_swarm.py, which bench.gateway_capacity serves through gunicorn: the gateway's app over a swarm that
answers every step at once serves the dialects as over a real one (a streamed OpenAI chat, a Petals HTTP
generation), every requested token comes, and each step's outputs are its inputs, handed back from the swarm's
own thread as the real client's event loop hands them."""

from __future__ import annotations

import json
import threading

import torch

from bench.gateway_capacity import NO_SWARM
from bench.instant_swarm import InstantRemote, create_instant_app

TOKENS = 12


def test_the_instant_app_streams_every_token_of_a_chat(tiny_llama, monkeypatch, tmp_path):
    for name, value in {"MODEL": str(tiny_llama), "INITIAL_PEERS": NO_SWARM[0], "SESSION_STORE": str(tmp_path / "s"),
                        "WARM_SESSIONS": "0", "REQUESTS_PER_MINUTE": "0"}.items():
        monkeypatch.setenv(name, value)
    client = create_instant_app().test_client()
    assert client.get("/health").json["covered"] is True
    body = {"model": tiny_llama.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}  # no stop token: every requested token
    events = [line[len("data: "):] for line in client.post("/v1/chat/completions", json=body).text.splitlines()
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == TOKENS
    petals = client.post("/api/v1/generate", data={"inputs": "a b", "max_new_tokens": 3})
    assert petals.status_code == 200 and petals.json["ok"] is True and isinstance(petals.json["outputs"], str)


def test_a_step_s_outputs_are_its_inputs_from_the_swarm_s_own_thread(tiny_llama):
    remote = InstantRemote(str(tiny_llama))
    hidden = remote.embed_rows(torch.tensor([[1, 2, 3]]), [0])
    answered, done = [], threading.Event()

    def on_done(key, outputs, error):
        answered.append((key, outputs, error, threading.current_thread()))
        done.set()

    remote.start_steps([("key", remote.session(8), hidden, 0)], on_done)
    assert done.wait(10)
    [(key, outputs, error, thread)] = answered
    assert key == "key" and outputs is hidden and error is None and thread is not threading.current_thread()
    assert remote.logits_on_device(hidden).shape == (1, 3, remote.config.vocab_size)
