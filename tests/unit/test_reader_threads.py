"""The WebSocket readers' threads (gateway/web/reader_threads.py): connections coming and going reuse threads, so a
thousand clients leaving at once end no threads (ending threads queue on one lock of `threading`, and /health
stalled behind them)."""

from __future__ import annotations

import threading
import time

from gateway.web.reader_threads import PooledThread, ReaderPool


def run_readers(pool: ReaderPool, count: int) -> None:
    """`count` readers at once, each held until all have started, then let go together."""
    started, release = threading.Semaphore(0), threading.Event()

    def reader():
        started.release()
        release.wait(10)

    finished = []
    for _ in range(count):
        done = threading.Event()
        finished.append(done)
        pool.run(lambda done=done: (reader(), done.set()))
    for _ in range(count):
        assert started.acquire(timeout=10)
    release.set()
    for done in finished:
        assert done.wait(10)


def test_readers_reuse_the_threads_of_readers_that_ended():
    pool = ReaderPool("test-reader")
    run_readers(pool, 20)
    assert pool.threads == 20
    for _ in range(3):  # the same crowd again, and a smaller one: no thread more
        run_readers(pool, 20)
        run_readers(pool, 5)
    assert pool.threads == 20
    run_readers(pool, 25)  # a bigger crowd grows the pool by the difference only
    assert pool.threads == 25


def test_a_failing_reader_leaves_its_thread_serving():
    pool = ReaderPool("test-failing")
    pool.run(lambda: 1 / 0)
    deadline = time.monotonic() + 10
    while pool.idle < 1:  # the failed reader's thread waits for the next one
        assert time.monotonic() < deadline
        time.sleep(0.01)
    run_readers(pool, 1)
    assert pool.threads == 1


def test_a_pooled_thread_joins_like_a_thread():
    release = threading.Event()
    thread = PooledThread(target=lambda: release.wait(10))
    thread.start()
    thread.join(0.05)
    assert thread.is_alive()
    release.set()
    thread.join(10)
    assert not thread.is_alive()


def test_the_gateway_gives_flask_sock_the_pooled_threads(tmp_path):
    from config import GatewaySettings, ModelConfig, Settings, SwarmSettings
    from gateway import create_app

    gateway = GatewaySettings(models=(ModelConfig("m", "m"),))
    app = create_app(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway))
    assert app.config["SOCK_SERVER_OPTIONS"]["thread_class"] is PooledThread
