"""Waiting out a gap: the only server of one span stops, and a new one starts for it a few seconds later. A new
request made in the gap waits for it (told once: a log line, the metrics, its hook) and then generates exactly
the local model's greedy tokens; with a wait shorter than the gap, it fails with the missing-blocks error."""

import logging
import threading
import time

import pytest
import torch
import transformers

from swarm.client import SwarmClient, metrics
from swarm.client.remote_model import RemoteModel
from swarm.protocol import MissingBlocksError

PREFIX = "gap"
PROMPT = [5, 17, 42, 99, 7]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def first_span(tiny_swarm):
    """Blocks 0:2 of the gap model; blocks 2:4 have a server only while a test starts one."""
    server = tiny_swarm.add_server(["--blocks", "0:2", "--dht-prefix", PREFIX])
    yield server
    server.stop()


def start_second_span(tiny_swarm, wait=True):
    return tiny_swarm.add_server(["--blocks", "2:4", "--dht-prefix", PREFIX], wait=wait)


def remote(tiny_swarm, tiny_llama, block_wait: float) -> RemoteModel:
    return RemoteModel(tiny_llama, SwarmClient(tiny_swarm.initial_peers, block_wait=block_wait), "tiny-gap", PREFIX)


def local_greedy(tiny_llama) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False)[0].tolist()
    return ids[len(PROMPT):]


def greedy(model, on_wait=None) -> list[int]:
    with model.session(max_length=len(PROMPT) + NEW_TOKENS, on_wait=on_wait) as session:
        tokens = [int(session.step([PROMPT])[0].argmax())]
        while len(tokens) < NEW_TOKENS:
            tokens.append(int(session.step([[tokens[-1]]])[0].argmax()))
    return tokens


def waits(outcome: str) -> float:
    return metrics.BLOCK_WAITS.labels(outcome)._value.get()


def test_a_request_in_the_gap_waits_for_a_new_server_and_matches_the_local_model(tiny_swarm, tiny_llama,
                                                                                  first_span, caplog):
    start_second_span(tiny_swarm).stop()  # served, then gone: it withdrew its record
    model = remote(tiny_swarm, tiny_llama, block_wait=300)
    told, waiting_now, result = [], [], {}

    def on_wait(message):
        told.append(message)
        waiting_now.append(metrics.WAITING_FOR_BLOCKS._value.get())

    def request():
        try:
            result["tokens"] = greedy(model, on_wait)
        except Exception as error:  # shown by the assertion below
            result["tokens"] = error

    served_before = waits("served")
    try:
        with caplog.at_level(logging.INFO, logger="swarm.client"):
            thread = threading.Thread(target=request)
            thread.start()
            deadline = time.monotonic() + 120
            while not told and thread.is_alive() and time.monotonic() < deadline:  # the request is in the gap
                time.sleep(0.1)
            assert told == ["no server holds blocks 2..3 of tiny-gap; waiting up to 300 s"], result
            replacement = start_second_span(tiny_swarm, wait=False)
            thread.join(300)
        assert result["tokens"] == local_greedy(tiny_llama)
    finally:
        model.close()
    assert waiting_now[0] >= 1 and waits("served") == served_before + 1
    client_warnings = [record.getMessage() for record in caplog.records
                       if record.name.startswith("swarm.client") and record.levelno == logging.WARNING]
    assert client_warnings == told  # one line for the wait, not one per look at the swarm
    replacement.stop()


def test_with_a_wait_shorter_than_the_gap_the_missing_blocks_are_named(tiny_swarm, tiny_llama, first_span):
    model = remote(tiny_swarm, tiny_llama, block_wait=3)
    gave_up_before = waits("gave_up")
    try:
        began = time.monotonic()
        with pytest.raises(MissingBlocksError, match=r"^no server holds blocks 2\.\.3 of tiny-gap$"):
            greedy(model)
        waited = time.monotonic() - began
    finally:
        model.close()
    assert 3 <= waited < 3 + 60  # about the wait: not at once, and not a whole other wait
    assert waits("gave_up") == gave_up_before + 1
