"""One reply, timed token by token, through each way in: the swarm's Python client, the gateway's WebSocket
API (Petals Chat's /api/v2/generate) and its OpenAI-compatible API (SSE, with the official `openai` client).

Every call returns a TokenStream; a remote failure or the deadline ends the stream early with its `error`
set rather than raising, so one bad session among many does not lose the others' figures.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Iterator

from bench.stats import NAN, TokenStream
from bench.workload import Prompt, session_length


def swarm_client_reply(remote, prompt: Prompt, max_new_tokens: int, speculative_tokens: int = 0) -> TokenStream:
    """Greedy generation over a RemoteModel (embeddings and LM head in this process): swarm.client.generate, or,
    with `speculative_tokens`, drafts of up to that many tokens as the gateway makes them (speculative_steps)."""
    from swarm.client.generate import generate

    stream = TokenStream(sent=time.perf_counter())
    if speculative_tokens:
        steps = speculative_steps(remote, prompt.ids, max_new_tokens, speculative_tokens)
    else:
        steps = ([token] for token in generate(remote, prompt.ids, max_new_tokens))
    for tokens in steps:
        stream.arrivals += [time.perf_counter()] * len(tokens)  # a step's tokens arrive together
    return stream


def speculative_steps(model, ids: list[int], max_new_tokens: int, most: int) -> Iterator[list[int]]:
    """Greedy speculative decoding through the Python client, drafted and paced as the gateway's engine does
    (gateway/engine/speculation.py: prompt lookup, a draft's length from measured step costs and acceptance):
    each step sends the pending token and a draft, gets the logits after every position, and keeps the draft up
    to its first token greedy decoding would not choose, plus the token chosen there. Yields each step's new
    tokens; the same tokens as swarm.client.generate, ending at a stop token or max_new_tokens."""
    from gateway.engine.speculation import Pacing, StepCosts, prompt_lookup

    costs, stops = StepCosts(), model.stop_token_ids
    pacing = Pacing(costs, most)
    with model.session(max_length=len(ids) + max_new_tokens) as session:
        context = list(ids)  # the last token is pending: not yet in the servers' caches
        chosen = [int(session.step([ids])[0].argmax())]
        while True:
            kept = _kept(chosen, stops, max_new_tokens - (len(context) - len(ids)))
            if kept:
                yield kept
            context += kept
            if len(kept) < len(chosen) or len(context) - len(ids) >= max_new_tokens:
                return  # a stop token, or the reply is whole
            draft = prompt_lookup(context, min(pacing.length(), max_new_tokens - (len(context) - len(ids)) - 1))
            began = time.perf_counter()
            logits = session.step([[context[-1], *draft]], position=len(context) - 1, every_position=True)[0]
            costs.observed(1 + len(draft), time.perf_counter() - began)
            greedy = logits.argmax(-1).tolist()
            accepted = next((index for index, token in enumerate(draft) if token != greedy[index]), len(draft))
            if draft:
                pacing.drafted(len(draft), accepted)
            else:
                pacing.undrafted()
            chosen = [*draft[:accepted], greedy[accepted]]


def _kept(tokens: list[int], stops, room: int) -> list[int]:
    """The tokens of a step a reply keeps: up to the first stop token (left out) and at most `room`."""
    kept = []
    for token in tokens[:room]:
        if token in stops:
            break
        kept.append(token)
    return kept


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
