"""n choices for one prompt: forks of one prefill, decoded together.

The prompt goes through the swarm once, up to its last token; each choice then runs on a fork of the session (its
servers share the prompt's cache, copy-on-write: swarm.client's fork) from that last token, and all the choices are
started before any is read, so the engine loop steps them in the same ticks. Their deltas come choice after choice
(the later ones wait in their output streams meanwhile). The first choice continues the request's own session; the
forks are closed once the replies are read.

Each fork is a session on the servers, so each holds a slot under MAX_SESSIONS and its client's cap while it lives
(held before the prompt is computed: a request refused costs nothing): n choices never take more of the servers'
allowance than n sessions of the client's would.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator

from gateway.engine.sequences import restore


def generate_choices(engine, session, requests: list, cancelled: Callable[[], bool], stats) -> Iterator[tuple]:
    """(choice index, delta) of every choice in turn. requests[0] carries the prompt's tokens past what the session
    holds (input_ids); the others only their own sampling (seeds)."""
    with engine.sessions.reserve(session.owner, len(requests) - 1):
        yield from _choices(engine, session, requests, cancelled, stats)


def _choices(engine, session, requests: list, cancelled: Callable[[], bool], stats) -> Iterator[tuple]:
    prompt = session.history + session.pending + list(requests[0].input_ids)
    if len(prompt) - 1 > len(session.history):  # the prompt but its last token, into the servers' caches once
        engine.prefill(session, prompt[len(session.history) + len(session.pending) : -1])
    restore(session, prompt[:-1], prompt[-1:])
    if stats is not None:
        stats.prompt(len(prompt) - 1)
    forks = []
    replies: list = []
    try:
        for _ in requests[1:]:
            forks.append(session.forked(len(prompt) - 1))
            restore(forks[-1], prompt[:-1], prompt[-1:])
        prepared = [engine.prepare_reply(choice_session, replace(request, input_ids=()), cancelled, stats)
                    for choice_session, request in zip([session, *forks], requests)]
        replies = [deltas for _, deltas in prepared]
        engine.loop_of(session.model).submit(*(sequence for sequence, _ in prepared))  # in the same tick
        for index, reply in enumerate(replies):
            for delta in reply:
                yield index, delta
    finally:
        for reply in replies:
            reply.close()
        for fork in forks:
            fork.close()
