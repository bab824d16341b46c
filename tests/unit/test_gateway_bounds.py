"""What one client's request may make the gateway hold: Ai00's /embeds counts its chunks and caps the copies of its
prefix before making one (issue 32, item 5)."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from config import GatewaySettings, Limits, ModelConfig, Settings, SwarmSettings
from gateway import create_app


class WordEncoder:
    """An encoder whose tokens are words, with [CLS] and [SEP] around each input, as a BERT's are."""

    name, max_tokens = "words", 512

    def token_counts(self, texts):
        return [len(text.split()) + 2 for text in texts]

    def chunks(self, text, size):
        words = text.split()
        return [" ".join(words[start:start + size]) for start in range(0, len(words), size)]

    def encode(self, texts, dimensions=None, normalize=False):
        return [[float(len(text))] for text in texts]


class OneEncoder:
    def __init__(self):
        self.encoder = WordEncoder()

    def first(self, name):
        return self.encoder

    def get(self, name):
        return None

    def refuse_chat(self, name):
        pass


@pytest.fixture
def client(tmp_path):
    gateway = GatewaySettings(models=(ModelConfig("m", "m"),))
    app = create_app(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway))
    app.extensions["engine"].encoders = OneEncoder()
    return app.test_client()


def posted_with_peak(client, body: dict):
    """The reply, and the most memory Python held while the gateway answered it."""
    tracemalloc.start()
    try:
        reply = client.post("/v1/embeds", json=body)
        return reply, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("chunks, field, says", [(4000, "input", "MAX_INPUTS_PER_REQUEST"),
                                                  (1000, "prefix", "MAX_BODY_BYTES")])
def test_embeds_counts_its_chunks_and_caps_the_prefixs_copies_before_making_them(client, chunks, field, says):
    """A 20 KB prefix before each of a text's one-word chunks: 4,000 of them were 80 MB of strings made before they
    were counted (a 1 MiB body: tens of GB), 1,000 were 20 MB made and embedded; now each is refused first, naming
    the field and the limit, and the request holds little more than its body."""
    body = {"input": "word " * chunks, "max_tokens": 1, "prefix": "x" * 20_000}
    refused, peak = posted_with_peak(client, body)
    assert peak < 8 << 20, f"{peak / 2 ** 20:.0f} MiB held for a {20 + chunks * 5 // 1000} KB request"
    assert refused.status_code == 400 and refused.json["error"]["param"] == field
    assert says in refused.json["error"]["message"] and str(chunks) in refused.json["error"]["message"]
    fine = client.post("/v1/embeds", json={"input": "a b c d e", "max_tokens": 2, "prefix": "q:"})
    assert fine.status_code == 200 and [chunk["chunk"] for chunk in fine.json["data"][0]["chunks"]] == \
        ["a b", "c d", "e"]


def test_a_prefix_that_leaves_no_room_for_a_chunk_is_refused(client):
    refused = client.post("/v1/embeds", json={"input": "a b", "prefix": "p " * 510})
    assert refused.status_code == 400 and refused.json["error"]["param"] == "prefix"
    assert "512 tokens" in refused.json["error"]["message"] and "no room" in refused.json["error"]["message"]


def test_an_unknown_session_id_is_echoed_only_in_part(client):
    """A 100,000-character id came back whole in the 404 (item 10)."""
    long_id = "A" * 100_000
    for path in ("/api/v1/generate", "/api/v1/close_inference_session"):
        unknown = client.post(path, json={"session_id": long_id, "inputs": "hi"})
        assert unknown.status_code == 404, unknown.json
        assert len(unknown.data) < 1000 and "A" * 64 in unknown.json["error"], len(unknown.data)
    short = client.post("/api/v1/close_inference_session", json={"session_id": "no-such-id"})
    assert "'no-such-id'" in short.json["error"]


# ------------------------------------------------------------------------------------- saved states (item 6)


class FakeInference:
    def park(self):
        pass


class FakeSession:
    def __init__(self):
        self.history, self.inference, self.closed = [], FakeInference(), False

    def close(self):
        self.closed = True


class FakeModel:
    name, config = "m", ModelConfig("m", "m", max_session_length=64)


def engine_with(monkeypatch, tmp_path, prefill=lambda session, ids: None, **limits):
    """An engine whose sessions are stand-ins and whose prefills are `prefill`, each call of it counted."""
    from gateway.engine.generation import Engine

    gateway = GatewaySettings(models=(ModelConfig("m", "m"),), limits=Limits(**limits))
    engine = Engine(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway))
    engine.prefills = []
    monkeypatch.setattr(engine, "_warm_session", lambda model, key, max_length=0: FakeSession())

    def counted(session, ids):
        engine.prefills.append(ids)
        prefill(session, ids)

    monkeypatch.setattr(engine, "prefill", counted)
    return engine


def test_a_save_over_a_cap_is_refused_before_its_prefix_is_computed(monkeypatch, tmp_path):
    """With both caps at 1, refused saves were computed on the swarm all the same (the cap was checked after)."""
    from gateway.errors import TooManySessions

    engine = engine_with(monkeypatch, tmp_path, max_sessions_per_client=1, max_saved_states_per_client=1,
                         max_saved_states=2)
    engine.save_state(FakeModel(), "first", [1, 2, 3], "key:a")
    for name in ("b", "c", "d", "e", "f"):
        with pytest.raises(TooManySessions, match="MAX_SAVED_STATES_PER_CLIENT"):
            engine.save_state(FakeModel(), name, [4, 5], "key:a")
    assert engine.prefills == [[1, 2, 3]]  # none of the refused five computed
    engine.save_state(FakeModel(), "first", [6], "key:a")  # saving a name again takes no more room
    engine.save_state(FakeModel(), "other", [7], "key:b")
    with pytest.raises(TooManySessions, match="MAX_SAVED_STATES\\)"):  # the gateway's cap, over all clients
        engine.save_state(FakeModel(), "third", [8], "key:c")
    assert engine.prefills == [[1, 2, 3], [6], [7]]


def test_a_saves_prefill_holds_one_of_its_clients_session_slots(monkeypatch, tmp_path):
    """A save computed its prefix outside the client's slots: MAX_SESSIONS_PER_CLIENT=1 let prefills run at once."""
    import threading

    from gateway.errors import TooManySessions

    started, finish = threading.Event(), threading.Event()

    def first_waits(session, ids):
        if ids == [1]:
            started.set()
            finish.wait(5)

    engine = engine_with(monkeypatch, tmp_path, first_waits, max_sessions_per_client=1)
    first = threading.Thread(target=engine.save_state, args=(FakeModel(), "a", [1], "key:a"))
    first.start()
    try:
        assert started.wait(5)
        with pytest.raises(TooManySessions, match="MAX_SESSIONS_PER_CLIENT"):
            engine.save_state(FakeModel(), "b", [2], "key:a")
    finally:
        finish.set()
        first.join(5)
    assert engine.prefills == [[1]] and [state.name for state in engine.states.of("key:a")] == ["a"]


def test_saves_of_one_name_at_once_leave_only_the_kept_state_pinned(tmp_path):
    """The first save published its state, then pinned it: a second save of the name in between let it go (closed,
    not yet pinned), and the first then pinned a closed session for good."""
    import threading

    from gateway.engine.saved_states import SavedState, SavedStates
    from gateway.engine.warm import WarmKey

    pinning, go_on = threading.Event(), threading.Event()

    class Warm:
        def __init__(self):
            self.pinned = {}

        def pin(self, key, session):
            if session.slow:  # the first save's pin, overtaken by the second save (if the lock lets it)
                pinning.set()
                go_on.wait(0.5)
            self.pinned[id(session)] = session

        def unpin(self, session):
            self.pinned.pop(id(session), None)

    states, key = SavedStates(Warm(), max_per_client=4, max_total=8), WarmKey("m", "key:a")
    first, second = FakeSession(), FakeSession()
    first.slow, second.slow = True, False
    saving = threading.Thread(target=states.save, args=(SavedState("n", key, first),))
    saving.start()
    assert pinning.wait(5)
    overtaking = threading.Thread(target=states.save, args=(SavedState("n", key, second),))
    overtaking.start()
    overtaking.join(0.2)
    go_on.set()
    saving.join(5)
    overtaking.join(5)
    assert list(states.warm.pinned.values()) == [second] and first.closed and not second.closed
    states.delete("key:a", "n")
    assert states.warm.pinned == {} and second.closed


# ------------------------------------------------------------------------------------- messages (item 7)


def test_a_messages_unknown_fields_are_dropped_not_kept_with_the_conversation():
    """Unknown fields of a message (and of its content parts and tool calls) were kept: MLC's stateful conversations
    and the WebSocket chat's stored transcript carried them on, growing by whatever each turn sent."""
    from gateway.openai.schemas import ChatCompletionRequest
    from gateway.petals.schemas import WsGenerate
    from gateway.petals.websocket import ChatTranscript
    from gateway.web.bodies import parse

    junk = "j" * 100_000
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi", "junk": junk}], "junk": junk},
                {"role": "assistant", "content": None, "junk": junk, "tool_calls": [
                    {"id": "c1", "type": "function", "junk": junk,
                     "function": {"name": "f", "arguments": "{}", "junk": junk}}]}]
    request = parse(ChatCompletionRequest, {"messages": messages, "top_level_junk": 1})
    assert "top_level_junk" in request.model_extra  # a request's own unknown fields are still seen (and logged)
    kept = json.dumps([message.model_dump(mode="json") for message in request.messages])
    assert len(kept) < 1000 and "junk" not in kept, len(kept)
    assert request.messages[1].tool_calls[0].function.name == "f" and request.messages[0].content[0].text == "hi"

    transcript, session = ChatTranscript(None, list(parse(WsGenerate, {"type": "generate", "messages": messages})
                                                     .messages)), type("Session", (), {"state": {}})()
    transcript.keep_in(session)
    assert len(json.dumps(session.state)) < 1000
