"""Many simultaneous sessions through the gateway's WebSocket API, one thread (and connection) each."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

from bench.clients import websocket_reply
from bench.stats import TokenStream
from bench.workload import Prompt


def concurrent_replies(url: str, prompt: Prompt, max_new_tokens: int, sessions: int, timeout: float) -> list[TokenStream]:
    """`sessions` connections each open a session; once all are open, all generate at the same moment.
    Nothing runs past `timeout` seconds: a session still generating then stops with its tokens so far."""
    deadline = time.perf_counter() + timeout
    # a session that fails to open still arrives here (see websocket_reply): the others never wait for it
    everyone_open = threading.Barrier(sessions, timeout=timeout)

    def one_session() -> TokenStream:
        return websocket_reply(url, prompt, max_new_tokens, deadline, all_open=everyone_open.wait)

    pool = ThreadPoolExecutor(max_workers=sessions, thread_name_prefix="session")
    replies = [pool.submit(one_session) for _ in range(sessions)]
    try:
        # short waits: the kernel may hand a Ctrl-C's SIGINT to any thread, and Python raises KeyboardInterrupt
        # only when this (main) thread next runs Python code, not while it sleeps on a lock
        while wait(replies, timeout=0.5).not_done:
            pass
        return [reply.result() for reply in replies]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # after a Ctrl-C, stopping the gateway ends the sessions
