"""The default model through the gateway: greedy replies equal transformers' own greedy generate."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import requests
import torch
import transformers
from websockets.sync.client import connect

from conftest import ROOT, Gateway, free_port

pytestmark = pytest.mark.real_model

QUESTION = "What are three good reasons to learn to cook at home?"


@pytest.fixture(scope="module")
def real_gateway(real_swarm, tmp_path_factory):
    server = Gateway({"INITIAL_PEERS": " ".join(real_swarm.initial_peers), "MODEL": "SmolLM2-135M-Instruct"},
                     tmp_path_factory.mktemp("real-gateway") / "gunicorn.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def expected(real_model):
    tokenizer = transformers.AutoTokenizer.from_pretrained(real_model)
    model = transformers.AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           tokenize=False)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=48, do_sample=False)
    new = output[0, inputs["input_ids"].shape[1]:]
    return prompt, tokenizer.decode(new, skip_special_tokens=True), len(new), inputs["input_ids"].shape[1]


def test_http_greedy_equals_transformers(real_gateway, expected):
    prompt, text, count, _ = expected
    reply = requests.post(real_gateway.url + "/api/v1/generate",
                          json={"inputs": prompt, "max_new_tokens": 48}, timeout=120).json()
    assert reply == {"ok": True, "outputs": text, "token_count": count}


def test_websocket_greedy_equals_transformers(real_gateway, expected):
    prompt, text, _, prompt_tokens = expected
    with connect(real_gateway.ws_url) as ws:
        ws.send(json.dumps({"type": "open_inference_session", "max_length": 512}))
        assert json.loads(ws.recv(timeout=60)) == {"ok": True}
        ws.send(json.dumps({"type": "generate", "inputs": prompt, "max_new_tokens": 1, "stop_sequence": "<|im_end|>",
                            "max_length": prompt_tokens + 48}))
        frames = []
        while not frames or not frames[-1]["stop"]:
            frames.append(json.loads(ws.recv(timeout=60)))
    streamed = "".join(frame["outputs"] for frame in frames)
    assert streamed == text and len(frames) > 10


def test_python_app_py_answers_within_a_minute(tmp_path):
    """The README's run path: no initial peers, so app.py brings its own swarm; stopped by SIGTERM, it stops it."""
    port = free_port()
    began = time.monotonic()
    log = open(tmp_path / "app.log", "wb")
    env = {key: value for key, value in os.environ.items() if key not in ("INITIAL_PEERS", "MODELS", "MODEL")}
    app = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=ROOT, env=env, stdout=log,
                           stderr=subprocess.STDOUT)
    try:
        frames = []
        while time.monotonic() - began < 60 and not frames:
            try:
                with connect(f"ws://127.0.0.1:{port}/api/v2/generate", open_timeout=5) as ws:
                    ws.send(json.dumps({"type": "open_inference_session", "max_length": 128}))
                    if json.loads(ws.recv(timeout=30)) != {"ok": True}:
                        time.sleep(1)  # the worker is up but the swarm is not announced yet
                        continue
                    ws.send(json.dumps({"type": "generate", "inputs": "Hi!", "max_new_tokens": 5}))
                    frames.append(json.loads(ws.recv(timeout=30)))
            except (OSError, TimeoutError):
                time.sleep(0.5)
        assert frames and frames[0]["ok"] and frames[0]["token_count"] == 5, (tmp_path / "app.log").read_text()
        assert time.monotonic() - began < 60
        family = psutil.Process(app.pid).children(recursive=True)
        assert sum("swarm.server" in " ".join(child.cmdline()) for child in family) == 2
    finally:
        app.send_signal(signal.SIGTERM)
        app.wait(60)
        log.close()
    time.sleep(1)
    assert not [child for child in family if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]


def test_openai_chat_greedy_equals_transformers(real_gateway, expected):
    import openai

    _, text, count, prompt_tokens = expected
    client = openai.OpenAI(base_url=real_gateway.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=48,
                                           messages=[{"role": "user", "content": QUESTION}])
    assert reply.choices[0].message.content == text
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, count)


def test_chooses_ranks_paris_first(real_gateway):
    reply = requests.post(real_gateway.url + "/v1/chooses", timeout=60, json={
        "input": "The Eiffel Tower is located in the city of", "choices": [" Seattle", " Paris", " Shanghai"]})
    data = reply.json()["data"]
    assert data[0]["choice"] == " Paris" and data[0]["rank"] == 0 and data[0]["index"] == 1
    assert data[0]["perplexity"] < data[1]["perplexity"] < data[2]["perplexity"] or data[0]["perplexity"] < 3


def test_real_model_json_schema(real_gateway):
    import openai

    client = openai.OpenAI(base_url=real_gateway.url + "/v1", api_key="unused", max_retries=0)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=40,
        messages=[{"role": "user", "content": "Where is the Eiffel Tower? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}})
    data = json.loads(reply.choices[0].message.content)
    assert set(data) == {"city", "country"} and "Paris" in data["city"]
