"""The session store (gateway/engine/session_store.py): a real SQLite file, a real child process killed mid-write,
and engines over the tiny model in process (test_engine's stand-in for the swarm) that restart on one store."""

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from config import GatewaySettings, Limits, ModelConfig, Settings, SwarmSettings
from gateway import create_app
from gateway.engine.generation import Engine, GenerationRequest
from gateway.engine.sampling import SamplingParams
from gateway.engine.session_store import MERGED_PART_BYTES, SessionStore, SessionStoreError, holder_alive, open_store, this_process
from gateway.errors import NotFound, SessionBusy, TooManySessions
from test_engine import LocalRemote

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class FakeModel:
    name = "tiny"


def fake_session(session_id="s1", history=(1, 2, 3), pending=(4,), **fields):
    from gateway.engine.served import GatewaySession

    return GatewaySession(FakeModel(), None, 64, True, "key:a", id=session_id, history=list(history),
                          pending=list(pending), stored=True, **fields)


def test_a_saved_session_loads_as_it_was(tmp_path):
    store = SessionStore(tmp_path / "sessions.sqlite3")
    store.save(fake_session(reply_start=3, state={"chat": [{"role": "user", "content": "hi"}]}), idle_timeout=60)
    stored = SessionStore(tmp_path / "sessions.sqlite3").load("s1")  # another connection: what is on disk
    assert (stored.model, stored.owner, stored.max_length) == ("tiny", "key:a", 64)
    assert (stored.history, stored.pending, stored.reply_start) == ((1, 2, 3), (4,), 3)
    assert stored.state == {"chat": [{"role": "user", "content": "hi"}]}
    assert stored.holder == this_process() and stored.expires_at - stored.last_used == pytest.approx(60)
    store.delete("s1")
    assert store.load("s1") is None


def test_a_session_is_claimed_by_one_live_process_at_a_time(tmp_path):
    store = SessionStore(tmp_path / "sessions.sqlite3")
    store.save(fake_session(), idle_timeout=60)
    other = SessionStore(tmp_path / "sessions.sqlite3")
    other.holder = f"{os.getppid()}@{_start_time(os.getppid())}"  # a live process that is not this one
    assert store.held_elsewhere(store.load("s1")) is False and other.held_elsewhere(other.load("s1")) is True
    assert other.claim("s1") is None  # this process holds it
    store.release("s1", idle_timeout=60)
    assert store.load("s1").holder is None
    assert other.claim("s1").history == (1, 2, 3)
    assert store.held_elsewhere(store.load("s1")) and store.claim("s1") is None


def test_a_dead_holders_rows_are_claimable_until_they_expire_then_swept(tmp_path):
    store = SessionStore(tmp_path / "sessions.sqlite3")
    dead = _dead_process()
    assert not holder_alive(dead) and holder_alive(this_process())
    for session_id, idle_timeout in (("fresh", 60), ("stale", -1)):
        store.save(fake_session(session_id), idle_timeout)
    store._db.execute("UPDATE sessions SET holder = ?", (dead,))  # their gateway was killed
    assert store.claim("stale") is None
    assert store.sweep() == 1 and store.load("stale") is None
    assert store.claim("fresh").id == "fresh"
    store.save(fake_session("mine"), idle_timeout=-1)  # expired, but this (live) process holds it: not swept
    assert store.sweep() == 0 and store.load("mine") is not None


def test_a_process_killed_mid_write_loses_no_committed_save(tmp_path):
    """A child saves a growing session as fast as it can and says after each commit how long it is; killed with
    SIGKILL at some point of that, the file is intact and holds at least the last length it reported."""
    path = tmp_path / "sessions.sqlite3"
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{ROOT!r}]
        from gateway.engine.served import GatewaySession
        from gateway.engine.session_store import SessionStore
        class FakeModel:  # as this module's: what it imports (torch, transformers) would only slow the start
            name = "tiny"
        store = SessionStore({str(path)!r})
        for length in range(1, 100000):
            session = GatewaySession(FakeModel(), None, 64, True, "key:a", id="s1", history=list(range(length)),
                                     stored=True)
            store.save(session, idle_timeout=60)
            print(length, flush=True)
    """)], stdout=subprocess.PIPE, text=True)
    reported = [int(child.stdout.readline())]
    parent = SessionStore(path)
    for length in range(1, 31):  # this process writes meanwhile: SQLite's locks and the busy timeout share the file
        parent.save(fake_session("parent", history=range(length)), idle_timeout=60)
        reported.append(int(child.stdout.readline()))
    child.kill()
    child.wait()
    store = SessionStore(path)  # checked at open: a damaged file would raise
    stored = store.load("s1")
    assert len(stored.history) >= reported[-1] and stored.history == tuple(range(len(stored.history)))
    assert store.load("parent").history == tuple(range(30))


def test_threads_share_the_store(tmp_path):
    store = SessionStore(tmp_path / "sessions.sqlite3")

    def save_many(thread: int) -> None:
        for length in range(20):
            store.save(fake_session(f"t{thread}", history=range(length)), idle_timeout=60)
            assert store.load(f"t{thread}").history == tuple(range(length))

    threads = [threading.Thread(target=save_many, args=(number,)) for number in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.count() == 8 and all(store.load(f"t{number}").history == tuple(range(19)) for number in range(8))


def test_a_failed_transaction_leaves_the_last_committed_state(tmp_path):
    store = SessionStore(tmp_path / "sessions.sqlite3")
    store.save(fake_session(history=(1, 2)), idle_timeout=60)
    with pytest.raises(RuntimeError):
        with store._transaction():
            store._db.execute("DELETE FROM sessions")
            raise RuntimeError("killed mid-write")
    assert store.load("s1").history == (1, 2)


@pytest.mark.parametrize("damage", ["garbage", "newer schema", "foreign table", "a folder"])
def test_an_unusable_store_is_a_clear_error_naming_the_setting(tmp_path, damage):
    path = tmp_path / "sessions.sqlite3"
    if damage == "garbage":
        path.write_bytes(b"SQLite format 3\x00" + os.urandom(4096))
    elif damage == "newer schema":
        sqlite3.connect(path).execute("PRAGMA user_version=99").connection.close()
    elif damage == "foreign table":
        sqlite3.connect(path).execute("CREATE TABLE sessions (id TEXT)").connection.close()
    else:
        path.mkdir()
    with pytest.raises(SessionStoreError, match=f"SESSION_STORE={path}: cannot use the session store") as error:
        SessionStore(path)
    assert "Traceback" not in str(error.value) and error.value.__cause__ is None
    if damage != "a folder":
        assert path.read_bytes()  # never emptied or replaced: the operator decides


def test_the_setting_off_keeps_sessions_in_memory_and_the_default_is_a_file_in_the_cache(tmp_path):
    assert GatewaySettings.from_env({"SESSION_STORE": "off"}).session_store is None
    assert open_store(None) is None
    default = GatewaySettings.from_env({"SWARM_CACHE_DIR": str(tmp_path)}).session_store
    assert default == str(tmp_path / "sessions.sqlite3")
    assert GatewaySettings.from_env({"SESSION_STORE": str(tmp_path / "x.db")}).session_store == str(tmp_path / "x.db")


# ------------------------------------------------------------------------------------- engines restarting


@pytest.fixture(scope="module")
def remote(tiny_llama):
    return LocalRemote(tiny_llama)


def engine_on(store_path, tiny_llama, remote, **limits):
    """An engine (a gateway process) on the store at `store_path` (None: memory only)."""
    gateway = GatewaySettings(models=(ModelConfig("tiny", str(tiny_llama), max_session_length=64),),
                              limits=Limits(**{"max_sessions": 4, "session_idle_timeout": 60, **limits}),
                              session_store=str(store_path) if store_path else None)
    return Engine(Settings(swarm=SwarmSettings(cache_dir=tiny_llama), gateway=gateway), connect=lambda config: remote)


def generate(engine, session_id, inputs, tokens=6, owner=None):
    request = GenerationRequest(inputs, SamplingParams(), max_new_tokens=tokens)
    with engine.sessions.use(session_id, owner) as session:
        return "".join(delta.text for delta in engine.generate(session, request))


def test_a_restarted_engine_continues_a_session_exactly(tmp_path, tiny_llama, remote):
    store = tmp_path / "sessions.sqlite3"
    first = engine_on(store, tiny_llama, remote)
    session = first.open_session("tiny", 64, expires=True, owner="key:a")
    first.sessions.keep(session)
    before = generate(first, session.id, "Once upon a time")
    history = session.history + session.pending
    del first  # killed: nothing closed, nothing freed

    second = engine_on(store, tiny_llama, remote)
    after = generate(second, session.id, " and then", owner="key:a")
    replayed = remote.sessions[-1]
    assert replayed.sent[0] == history[:-1]  # the servers' caches rebuilt in one step, the pending token kept
    assert replayed.sent[1][0] == history[-1]

    never_stopped = engine_on(None, tiny_llama, remote)
    reference = never_stopped.open_session("tiny", 64, expires=True)
    assert (generate(never_stopped, reference.id, "Once upon a time"),
            generate(never_stopped, reference.id, " and then")) == (before, after)
    assert second.sessions.get(session.id).history == reference.history


def test_a_restored_session_keeps_its_owner_expiry_and_caps(tmp_path, tiny_llama, remote):
    store = tmp_path / "sessions.sqlite3"
    first = engine_on(store, tiny_llama, remote)
    opened = [first.open_session("tiny", 64, expires=True, owner="key:a") for _ in range(2)]
    for session in opened:
        first.sessions.keep(session)
    generate(first, opened[0].id, "Hello")
    SessionStore(store)._db.execute("UPDATE sessions SET holder = ?", (_dead_process(),))  # killed, no cleanup

    second = engine_on(store, tiny_llama, remote, max_sessions_per_client=1)
    with pytest.raises(NotFound):
        second.sessions.get(opened[0].id, "key:b")  # another key: as unknown as a wrong id
    assert second.sessions.get(opened[0].id, "key:a").owner == "key:a"
    with pytest.raises(TooManySessions):
        second.sessions.get(opened[1].id, "key:a")  # restored sessions count once open again
    assert SessionStore(store).load(opened[1].id).holder is None  # let go: it may come back later

    expired = first.open_session("tiny", 64, expires=True, owner="key:a")
    first.sessions.keep(expired)
    SessionStore(store)._db.execute("UPDATE sessions SET holder = ?, expires_at = ? WHERE id = ?",
                                    (_dead_process(), time.time() - 1, expired.id))  # idle past the timeout
    with pytest.raises(NotFound):
        second.sessions.get(expired.id, "key:a")

    second.close_session(second.sessions.get(opened[0].id))
    assert SessionStore(store).load(opened[0].id) is None  # closed for good
    third = engine_on(store, tiny_llama, remote, session_idle_timeout=0.05)
    session = third.sessions.get(opened[1].id, "key:a")
    session.last_used = time.monotonic() - 1
    assert third.sessions.expire_idle() == 1 and SessionStore(store).load(opened[1].id) is None


def test_a_session_open_in_another_live_process_is_not_opened_twice(tmp_path, tiny_llama, remote):
    store = tmp_path / "sessions.sqlite3"
    first = engine_on(store, tiny_llama, remote)
    session = first.open_session("tiny", 64, expires=False, owner="key:a")
    first.sessions.keep(session)
    parent = f"{os.getppid()}@{_start_time(os.getppid())}"
    SessionStore(store)._db.execute("UPDATE sessions SET holder = ?", (parent,))  # a second gunicorn worker's
    second = engine_on(store, tiny_llama, remote)
    with pytest.raises(SessionBusy, match="open in another process"):
        second.sessions.get(session.id, "key:a")
    with pytest.raises(SessionBusy, match="open on another connection"):
        first.sessions.resume(session.id, "key:a")  # a WebSocket's, still held by its first connection here

    SessionStore(store)._db.execute("UPDATE sessions SET holder = ?", (_dead_process(),))  # that worker died
    reopened = second.sessions.resume(session.id, "key:a")
    assert reopened.expires  # a WebSocket's session, reopened, expires when idle until a connection takes it up


def test_sessions_not_named_by_id_are_never_written(tmp_path, tiny_llama, remote):
    store = tmp_path / "sessions.sqlite3"
    engine = engine_on(store, tiny_llama, remote)
    session = engine.open_session("tiny", 64, expires=True)  # a stateless request's own session
    generate(engine, session.id, "Hi")
    engine.close_session(session)
    assert SessionStore(store).count() == 0


def _start_time(pid: int) -> str:
    import psutil

    return f"{psutil.Process(pid).create_time():.2f}"


def _dead_process() -> str:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    token = f"{child.pid}@{_start_time(child.pid)}"
    child.wait()
    return token


def test_a_session_whose_connection_ended_is_resumed_in_the_same_process(tmp_path, tiny_llama, remote):
    store = tmp_path / "sessions.sqlite3"
    engine = engine_on(store, tiny_llama, remote)
    session = engine.open_session("tiny", 64, expires=False, owner="key:a")
    engine.sessions.keep(session)
    generate(engine, session.id, "Hello")
    history = session.history + session.pending
    engine.sessions.detach(session)  # its WebSocket went away (websocket.Connection.leave_session)
    session.close()
    assert len(engine.sessions) == 0 and SessionStore(store).load(session.id).holder is None

    resumed = engine.sessions.resume(session.id, "key:a")
    assert resumed is not session and resumed.history + resumed.pending == history
    engine.close_session(resumed)  # close_inference_session: gone for good
    with pytest.raises(NotFound):
        engine.sessions.resume(session.id, "key:a")


def test_a_websocket_replys_last_frame_leaves_once_the_reply_is_stored(tmp_path, tiny_llama, remote):
    """A client that has read a whole reply and sees the gateway die the next moment resumes after that reply."""
    from test_no_tracebacks import FakeSocket, serve

    store = tmp_path / "sessions.sqlite3"
    engine = engine_on(store, tiny_llama, remote)
    opened = json.dumps({"type": "open_inference_session", "max_length": 64})
    turn = json.dumps({"type": "generate", "inputs": "Hello", "max_new_tokens": 2, "stream": True,
                       "max_reply_tokens": 6})
    stored_at_each_frame = []

    class StoreReadingSocket(FakeSocket):
        def send(self, data):
            super().send(data)
            if "session_id" not in self.frames[-1]:
                stored = SessionStore(store).load(self.frames[0]["session_id"])
                stored_at_each_frame.append(len(stored.history + stored.pending))

    ws = StoreReadingSocket(opened, turn)
    app = create_app(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=GatewaySettings(models=())))
    serve(app, ws, engine)
    replies = [frame for frame in ws.frames if "outputs" in frame]
    assert [frame["token_count"] for frame in replies] == [2, 2, 2] and replies[-1]["stop"]
    session = SessionStore(store).load(ws.frames[0]["session_id"])
    replied = len(session.history + session.pending)
    # frames before the last go out as they come; the last only once the session holds the whole reply on disk
    assert stored_at_each_frame[2] == replied and stored_at_each_frame[0] < replied


# ------------------------------------------------------------------------------------- what a save writes


def pages_written(store: SessionStore) -> int:
    """The pages SQLite wrote since the last call: the write-ahead log's frames; then the log is emptied."""
    frames = store._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1]
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return frames


def test_a_turn_writes_its_own_size_however_long_the_conversation(tmp_path):
    """Each save rewrote the whole row (token ids and transcript): a WebSocket chat's turns cost more and more (50 MiB
    and 246 ms a turn after 30 turns with big messages); now a turn writes its new items, the row's few fields, and
    at most one bounded merge of small parts."""
    store = SessionStore(tmp_path / "sessions.sqlite3")
    session = fake_session(history=(), pending=())
    transcript, pages = [], []
    for turn in range(40):
        transcript += [{"role": "user", "content": f"question {turn} " + "x" * 2000},
                       {"role": "assistant", "content": f"answer {turn} " + "y" * 2000}]
        session.history += list(range(turn * 300, turn * 300 + 300))
        session.state = {"chat": list(transcript), "mode": "chat"}
        pages_written(store)
        store.save(session, idle_timeout=60)
        pages.append(pages_written(store))
    # flat: the 40th turn writes what the 2nd did, and at most one merge of small parts (a rewrite of the whole
    # transcript would be 40 pages by then)
    assert max(pages[-10:]) <= max(pages[1:5]) + MERGED_PART_BYTES // 4096 + 2, pages
    stored = SessionStore(tmp_path / "sessions.sqlite3").load("s1")
    assert stored.history == tuple(range(12000)) and stored.state == {"chat": transcript, "mode": "chat"}


def test_every_edit_of_a_sessions_lists_loads_back_as_it_was(tmp_path):
    """Grown, rewound (regenerate), edited in the middle (a template that rewrote a turn), emptied: whatever the
    lists become, the parts a save keeps and writes load as exactly that, in this process and in another."""
    import random

    rng = random.Random(7)
    store = SessionStore(tmp_path / "sessions.sqlite3")
    session = fake_session(history=(), pending=())
    for step in range(150):
        chat, kind = list(session.state.get("chat", [])), rng.choice(["grow", "grow", "rewind", "edit", "empty"])
        if kind == "grow":
            session.history += [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
            chat.append({"role": "user", "content": str(step)})
        elif kind == "rewind":
            del session.history[rng.randrange(len(session.history) + 1):]
            chat = chat[:rng.randrange(len(chat) + 1)]
        elif kind == "edit" and session.history:
            session.history[rng.randrange(len(session.history))] = -step
            chat = [{"role": "system", "content": "new"}] + chat[1:]
        else:
            session.history, chat = [], []
        session.state = {"chat": chat}
        store.save(session, idle_timeout=60)
        for reader in (store, SessionStore(tmp_path / "sessions.sqlite3")) if step % 25 == 0 else (store,):
            stored = reader.load("s1")
            assert (list(stored.history), stored.state.get("chat", [])) == (session.history, chat), (step, kind)
    store.delete("s1")
    assert store._db.execute("SELECT COUNT(*) FROM session_parts").fetchone()[0] == 0


def test_a_long_conversation_keeps_few_parts_and_a_save_encodes_only_what_it_writes(tmp_path, monkeypatch):
    """A session gained a part every turn (a load read one row per turn), and each save re-encoded the whole
    transcript to tell what changed (a turn's CPU grew with the conversation): now parts merge as they pile up, at
    few of them (geometric sizes up to MERGED_PART_BYTES), and what a save encodes is what it writes, each item a
    few times over its life."""
    import math

    from gateway.engine import session_store

    encoded = []

    def dumps(value):
        text = json.dumps(value)
        encoded.append(len(text))
        return text

    monkeypatch.setattr(session_store, "json", type("Json", (), {"dumps": staticmethod(dumps), "loads": json.loads}))
    store = SessionStore(tmp_path / "sessions.sqlite3")
    session, transcript, turns = fake_session(history=(), pending=()), [], 100
    for turn in range(turns):
        transcript += [{"role": "user", "content": f"question {turn} " + "x" * 500},
                       {"role": "assistant", "content": f"answer {turn} " + "y" * 500}]
        session.history += list(range(turn * 50, turn * 50 + 50))
        session.state = {"chat": [dict(entry) for entry in transcript]}  # afresh, as a dialect builds it
        store.save(session, idle_timeout=60)
    parts = dict(store._db.execute("SELECT list, COUNT(*) FROM session_parts GROUP BY list").fetchall())
    whole = len(json.dumps(transcript))
    assert parts["history"] <= math.log2(len(session.history)) + 1  # 5,000 token ids: under the bound, all merged
    assert parts["state.chat"] <= whole / (MERGED_PART_BYTES / 2) + math.log2(turns * 2) + 1, parts
    assert sum(encoded) < 8 * whole, sum(encoded) / whole  # was a whole transcript a save: 50 of them
    stored = SessionStore(tmp_path / "sessions.sqlite3").load("s1")
    assert list(stored.history) == session.history and stored.state == {"chat": transcript}


def test_a_store_of_the_first_schema_is_carried_over(tmp_path):
    """A file of schema 1 (the lists in the sessions row) opens with its sessions as they were."""
    path = tmp_path / "sessions.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE sessions (id TEXT PRIMARY KEY, model TEXT NOT NULL, owner TEXT NOT NULL, max_length "
               "INTEGER NOT NULL, history TEXT NOT NULL, pending TEXT NOT NULL, reply_start INTEGER, state TEXT NOT "
               "NULL, holder TEXT, last_used REAL NOT NULL, expires_at REAL NOT NULL, updated_at REAL NOT NULL)")
    state = {"chat": [{"role": "user", "content": "hi"}], "mode": "chat"}
    db.execute("INSERT INTO sessions VALUES ('old', 'tiny', 'key:a', 64, '[5, 6, 7]', '[8]', 2, ?, NULL, 1, ?, 1)",
               (json.dumps(state), time.time() + 60))
    db.execute("PRAGMA user_version=1")
    db.commit()
    db.close()
    store = SessionStore(path)
    stored = store.load("old")
    assert (stored.history, stored.pending, stored.reply_start, stored.state) == ((5, 6, 7), (8,), 2, state)
    assert store.claim("old").owner == "key:a"
