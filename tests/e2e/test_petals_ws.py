"""Petals Chat's WebSocket API, /api/v2/generate, through real gunicorn, driven with the `websockets` client."""

import json
import logging
from unittest.mock import ANY

import pytest
import requests
from websockets.sync.client import connect


def send(ws, **message):
    ws.send(json.dumps(message))


def receive(ws) -> dict:
    raw = ws.recv(timeout=60)
    assert "Traceback" not in raw
    return json.loads(raw)


def read_reply(ws) -> list[dict]:
    frames = []
    while True:
        frame = receive(ws)
        frames.append(frame)
        if not frame.get("ok") or frame.get("stop"):
            return frames


@pytest.fixture
def ws(gateway):
    with connect(gateway.ws_url) as connection:
        yield connection


def open_session(ws, max_length=128):
    send(ws, type="open_inference_session", max_length=max_length)
    opened = receive(ws)
    assert opened == {"ok": True, "session_id": ANY} and isinstance(opened["session_id"], str)
    return opened["session_id"]


def http_greedy(gateway, inputs, count):
    return requests.post(gateway.url + "/api/v1/generate", json={"inputs": inputs, "max_new_tokens": count}).json()


def test_one_reply_without_stop_sequence(gateway, ws):
    open_session(ws)
    send(ws, type="generate", inputs="Hello, world!", max_new_tokens=6)
    [frame] = read_reply(ws)
    expected = http_greedy(gateway, "Hello, world!", 6)
    assert frame == {"ok": True, "outputs": expected["outputs"], "stop": True, "token_count": 6,
                     "finish_reason": "length"}


def test_streams_token_by_token_until_a_multi_token_stop(gateway, ws):
    full = http_greedy(gateway, "Numbers:", 30)["outputs"]
    stop = full[10:14]
    expected = full[: full.index(stop) + len(stop)]
    open_session(ws)
    send(ws, type="generate", inputs="Numbers:", max_new_tokens=1, stop_sequence=stop)
    frames = read_reply(ws)
    assert all(frame["token_count"] == 1 for frame in frames) and len(frames) >= 3
    assert [frame["stop"] for frame in frames] == [False] * (len(frames) - 1) + [True]
    assert "".join(frame["outputs"] for frame in frames) == expected
    shown = ""
    for frame in frames[:-1]:  # before the stop completes, no frame ends in half of it
        shown += frame["outputs"]
        assert not any(shown.endswith(stop[:length]) for length in range(1, len(stop)))


def test_extra_stop_sequences_and_chunks(gateway, ws):
    full = http_greedy(gateway, "Hello", 30)["outputs"]
    stop = full[12:15]
    open_session(ws)
    send(ws, type="generate", inputs="Hello", max_new_tokens=4, stop_sequence="never-generated-zzz",
         extra_stop_sequences=[stop])
    frames = read_reply(ws)
    assert all(frame["token_count"] == 4 for frame in frames[:-1])
    assert "".join(frame["outputs"] for frame in frames) == full[: full.index(stop) + len(stop)]


def test_stop_message_ends_the_reply_and_keeps_the_session(gateway, ws):
    open_session(ws, max_length=256)
    send(ws, type="generate", inputs="Go on:", max_new_tokens=1, stop_sequence="never-generated-zzz")
    first = [receive(ws) for _ in range(3)]
    send(ws, type="stop")
    rest = read_reply(ws)
    frames = first + rest
    assert frames[-1]["stop"] is True and len(frames) < 60  # stopped long before the session was full
    generated = sum(frame["token_count"] for frame in frames)

    send(ws, type="generate", inputs=" More:", max_new_tokens=2)  # the same session goes on
    [frame] = read_reply(ws)
    assert frame["ok"] and frame["token_count"] == 2
    assert generated > 0


def test_session_belongs_to_the_connection_and_can_be_closed(gateway, ws):
    open_session(ws)
    send(ws, type="close_inference_session")
    assert receive(ws) == {"ok": True}
    send(ws, type="generate", inputs="hi", max_new_tokens=1)
    error = receive(ws)
    assert error["ok"] is False and "open_inference_session first" in error["error"]
    open_session(ws)  # and the connection is still usable
    send(ws, type="generate", inputs="hi", max_new_tokens=1)
    assert read_reply(ws)[-1]["ok"]


@pytest.mark.parametrize(
    "message, fragment",
    [
        ("not json at all", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"type": "generate", "inputs": "x"}), "open_inference_session first"),
        (json.dumps({"type": "fly"}), "type: must be one of"),
        (json.dumps({"max_length": 5}), "type: must be one of"),
        (json.dumps({"type": "open_inference_session"}), "max_length: required to open a new session"),
        (json.dumps({"type": "open_inference_session", "max_length": "long"}), "max_length"),
        (json.dumps({"type": "open_inference_session", "max_length": -3}), "max_length"),
        (json.dumps({"type": "open_inference_session", "max_length": 10**8}), "max_length: at most 1024"),
        (json.dumps({"type": "open_inference_session", "max_length": 8, "model": "nope"}), "unknown model"),
    ],
)
def test_bad_messages_get_an_error_frame_and_the_connection_stays_usable(gateway, ws, message, fragment):
    ws.send(message)
    error = receive(ws)
    assert error["ok"] is False and fragment.lower() in error["error"].lower()
    assert error["traceback"] == error["error"]
    open_session(ws)
    send(ws, type="generate", inputs="ok", max_new_tokens=1)
    assert read_reply(ws)[-1]["ok"]


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 10**9}, "max_new_tokens: at most"),
        ({"max_new_tokens": "x"}, "max_new_tokens"),
        ({"inputs": ["list"]}, "inputs"),
        ({"inputs": "word " * 200, "max_new_tokens": 1}, "max_length"),
        ({"top_k": -2}, "top_k"),
        ({"extra_stop_sequences": "not a list"}, "extra_stop_sequences"),
    ],
)
def test_bad_generate_fields(gateway, ws, fields, fragment):
    open_session(ws, max_length=64)
    send(ws, type="generate", **{"inputs": "hi", **fields})
    error = receive(ws)
    assert error["ok"] is False and fragment in error["error"]
    send(ws, type="generate", inputs="hi", max_new_tokens=1)
    assert read_reply(ws)[-1]["ok"]


def test_a_stop_with_nothing_to_stop_is_ignored(gateway, ws):
    open_session(ws)
    send(ws, type="stop")
    send(ws, type="generate", inputs="hi", max_new_tokens=1)
    [frame] = read_reply(ws)
    assert frame["ok"] and frame["token_count"] == 1


def test_keepalive_pings(gateway, caplog):
    """The gateway pings an idle connection (every second in this test's configuration)."""
    logger = logging.getLogger("ws-client")
    with caplog.at_level(logging.DEBUG, logger="ws-client"):
        with connect(gateway.ws_url, logger=logger) as connection:
            open_session(connection)
            import time

            pinged = lambda: any(record.getMessage().startswith("< PING") for record in caplog.records)  # received
            deadline = time.monotonic() + 30  # idle until the gateway's first ping arrives (one a second)
            while time.monotonic() < deadline and not pinged():
                time.sleep(0.1)
            assert pinged()
            send(connection, type="generate", inputs="hi", max_new_tokens=1)
            assert read_reply(connection)[-1]["ok"]  # the connection lived through it


def test_chat_mode_sends_only_new_turns_and_regenerates(gateway, ws, tiny_swarm, tiny_llama):
    import transformers

    from swarm.client import SwarmClient

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    client = SwarmClient(tiny_swarm.initial_peers)
    first_server = min(client.servers("tiny", 4), key=lambda server: server.info.start)
    served = lambda: client.server_info(first_server.peer_id)["positions_served"]
    try:
        open_session(ws, max_length=1024)
        send(ws, type="generate", messages=[{"role": "user", "content": "Hello!"}], stream=True, max_new_tokens=1,
             max_reply_tokens=5, do_sample=False)
        first = read_reply(ws)
        assert len(first) == 5 and first[-1]["finish_reason"] == "length"
        reply = "".join(frame["outputs"] for frame in first)

        before = served()
        send(ws, type="generate", messages=[{"role": "user", "content": "More"}], stream=True, max_new_tokens=1,
             max_reply_tokens=3, do_sample=False)
        second = read_reply(ws)
        conversation = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": reply},
                        {"role": "user", "content": "More"}]
        whole = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        first_turn = tokenizer.apply_chat_template(conversation[:1], add_generation_prompt=True, tokenize=False)
        new_text = whole[len(first_turn) + len(reply):]
        assert new_text.startswith("<|im_end|>") and new_text.endswith("<|im_start|>assistant\n")
        new_tokens = len(tokenizer(new_text, add_special_tokens=False)["input_ids"])
        assert served() - before == 1 + new_tokens + (3 - 1)  # the pending token, the new turn, the reply

        send(ws, type="generate", regenerate=True, stream=True, max_new_tokens=1, max_reply_tokens=3, do_sample=False)
        again = read_reply(ws)
        assert [frame["outputs"] for frame in again] == [frame["outputs"] for frame in second]  # greedy: the same
    finally:
        client.shutdown()


def test_stopped_reply_says_cancelled(gateway, ws):
    open_session(ws, max_length=512)
    send(ws, type="generate", inputs="Tell me", stream=True, max_new_tokens=1)
    receive(ws)
    send(ws, type="stop")
    frames = read_reply(ws)
    assert frames[-1]["stop"] and frames[-1]["finish_reason"] == "cancelled"


def test_regenerate_needs_a_reply(gateway, ws):
    open_session(ws)
    send(ws, type="generate", regenerate=True, inputs="x")
    error = receive(ws)
    assert error["ok"] is False and "regenerate" in error["error"]


def chat_turn(ws, content, **fields) -> list[dict]:
    send(ws, type="generate", messages=[{"role": "user", "content": content}], stream=True, max_new_tokens=1,
         max_reply_tokens=4, do_sample=False, **fields)
    return read_reply(ws)


def test_a_chat_turn_that_fails_is_not_kept_in_the_transcript(gateway, ws):
    """Once, a turn too long for the session stayed in the transcript: every later turn failed the same way, and a
    turn retried after a failure was in it twice."""
    open_session(ws, max_length=64)
    [refused] = chat_turn(ws, "word " * 80)
    assert refused["ok"] is False and refused["code"] == "context_length_exceeded"
    [refused] = chat_turn(ws, "Hello there", max_length=4)  # a turn that fits the session, but not this request
    assert refused["ok"] is False and refused["code"] == "context_length_exceeded"
    retried = chat_turn(ws, "Hello there")
    assert retried[-1]["ok"] and retried[-1]["stop"], retried
    with connect(gateway.ws_url) as fresh:  # greedy: the same reply as the turn alone in a new conversation
        open_session(fresh, max_length=64)
        alone = chat_turn(fresh, "Hello there")
    assert [frame["outputs"] for frame in retried] == [frame["outputs"] for frame in alone]
