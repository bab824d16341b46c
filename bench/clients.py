"""One reply, timed token by token, through each way in: the swarm's Python client, the gateway's WebSocket
API (Petals Chat's /api/v2/generate) and its OpenAI-compatible API (SSE, with the official `openai` client).

Every call returns a TokenStream; a remote failure or the deadline ends the stream early with its `error`
set rather than raising, so one bad session among many does not lose the others' figures.
"""

from __future__ import annotations

import json
import time
from typing import Callable

from bench.stats import NAN, TokenStream
from bench.workload import Prompt, session_length


def swarm_client_reply(remote, prompt: Prompt, max_new_tokens: int) -> TokenStream:
    """Greedy generation with swarm.client.generate over a RemoteModel (embeddings and LM head in this process)."""
    from swarm.client.generate import generate

    stream = TokenStream(sent=time.perf_counter())
    for _ in generate(remote, prompt.ids, max_new_tokens):
        stream.arrivals.append(time.perf_counter())
    return stream


def websocket_reply(
    url: str, prompt: Prompt, max_new_tokens: int, deadline: float, all_open: Callable[[], None] = lambda: None,
) -> TokenStream:
    """Open an inference session on a new connection, then generate greedily with `stream: true` in frames of
    one token each, so that each frame's arrival is its token's. `all_open` is called once the session is open
    (or failed to open): simultaneous sessions wait there for each other, so that they generate together."""
    from websockets.sync.client import connect

    stream, ws = TokenStream(sent=NAN), None
    try:
        try:
            ws = connect(url, open_timeout=_left(deadline), max_size=None)
            open_session = {"type": "open_inference_session", "max_length": session_length(prompt, max_new_tokens)}
            ws.send(json.dumps(open_session))
            _check(json.loads(ws.recv(timeout=_left(deadline))))
        finally:
            all_open()  # also after a failure: the others must not wait for this session
        stream.sent = time.perf_counter()
        ws.send(json.dumps({"type": "generate", "inputs": prompt.text, "stream": True, "max_new_tokens": 1,
                            "max_reply_tokens": max_new_tokens}))
        while True:
            frame = _check(json.loads(ws.recv(timeout=_left(deadline))))
            stream.arrivals += [time.perf_counter()] * frame["token_count"]
            if frame["stop"]:
                return stream
    except Exception as error:
        stream.error = _describe(error, stream)
        return stream
    finally:
        if ws is not None:
            ws.close()  # the gateway then closes the session, and the servers free its cache


def openai_reply(base_url: str, model: str, prompt: Prompt, max_new_tokens: int, deadline: float) -> TokenStream:
    """A streamed /v1/chat/completions (temperature 0: greedy) read with the official `openai` client. The
    gateway sends a chunk per token that has text, so chunks are timed as they come and the token count is
    the usage's (stream_options.include_usage). The client's timeout bounds each read; the loop the whole."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", timeout=_left(deadline), max_retries=0)
    stream = TokenStream(sent=time.perf_counter())
    try:
        chunks = client.chat.completions.create(
            model=model, messages=prompt.messages, max_tokens=max_new_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in chunks:
            if time.perf_counter() > deadline:
                raise TimeoutError  # closing the client below ends the stream, and the gateway's generation
            if chunk.usage is not None:
                stream.token_count = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                stream.arrivals.append(time.perf_counter())
    except Exception as error:
        stream.error = _describe(error, stream)
    finally:
        client.close()
    return stream


class ReplyError(RuntimeError):
    """The gateway answered with an error frame."""


def _check(frame: dict) -> dict:
    if not frame.get("ok"):
        raise ReplyError(frame.get("error") or str(frame))
    return frame


def _left(deadline: float) -> float:
    """Seconds left before the deadline; a deadline already past still gives an immediate timeout, not a hang."""
    return max(0.001, deadline - time.perf_counter())


def _describe(error: Exception, stream: TokenStream) -> str:
    what = "timed out" if isinstance(error, TimeoutError) else f"{type(error).__name__}: {error}"
    return f"{what} (after {stream.tokens} tokens)"
