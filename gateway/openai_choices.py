"""The choices of one OpenAI request, planned and run: the lengths checked and the per-choice GenerationRequests
built (before any stream starts), then n choices for one prompt on one swarm session, and their deltas collected.

    choices, make_request = plan_generation(engine, model, fields, prompt_ids, "prompt", logprobs=top)
    model, tools, prompt_ids, (choices, make_request) = plan_chat(engine, fields)  # a chat: messages rendered first
    for index, delta in choices.run(make_request, cancelled, stats): ...   # streamed
    collect(choices.run(make_request, lambda: False, stats), n)           # whole replies
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator, Optional

from gateway import held_sessions
from gateway.access import client_id
from gateway.engine import Delta, Engine, GenerationRequest, ServedModel
from gateway.errors import BadRequest
from gateway.limits import check_context_length
from gateway.openai_params import max_new_tokens, offered_tools, requested_constraint, sampling_params, stop_fields
from gateway.prompts import render_chat


def plan_chat(engine: Engine, fields, **extra) -> tuple:
    """(model, the tools the reply may call, prompt ids, plan) of a chat request (schemas.ChatCompletionRequest):
    its messages rendered with the model's chat template, then planned as plan_generation does."""
    model = engine.model(fields.model)
    tool_choice, tools = offered_tools(fields)
    prompt = render_chat(model.tokenizer, fields.messages, tools)
    prompt_ids = model.encode(prompt, at_start=False)  # the template wrote any special tokens itself
    plan = plan_generation(engine, model, fields, prompt_ids, "messages",
                           tool_choice=(tool_choice, tools, fields.parallel_tool_calls), **extra)
    return model, tools, prompt_ids, plan


def plan_generation(engine: Engine, model: ServedModel, fields, prompt_ids: list[int], param: str, **extra):
    """Check the lengths, build the per-choice request, and open the session (before any stream starts)."""
    config = model.config
    if not prompt_ids:
        raise BadRequest(f"{param}: must not be empty", field=param)
    max_tokens = max_new_tokens(fields, engine.limits.max_new_tokens, config.max_session_length - len(prompt_ids))
    check_context_length(config, len(prompt_ids), max_tokens, param)
    sampling = sampling_params(fields, config.defaults, model.vocab_size)
    stop_sequences, stop_token_ids = stop_fields(fields)
    tool_choice = extra.pop("tool_choice", None)
    constraint = checked_constraint(model, requested_constraint(fields, tool_choice))

    def make_request(index: int) -> GenerationRequest:
        seed = None if sampling.seed is None else sampling.seed + index  # n different, reproducible choices
        return GenerationRequest(
            inputs=None, sampling=replace(sampling, seed=seed), max_new_tokens=max_tokens,
            stop_sequences=tuple(stop_sequences), include_stop=False, stop_token_ids=tuple(stop_token_ids),
            constraint=constraint, **extra)

    return Choices(engine, model, prompt_ids, max_tokens, fields.n), make_request


def checked_constraint(model: ServedModel, requested) -> Optional[Callable[[], object]]:
    """What makes each choice's grammar constraint, once the spec compiled: a bad one is a 400 naming its field."""
    if requested is None:
        return None
    from gateway.grammar import GrammarError

    spec, field = requested
    grammars = model.grammars()
    try:
        grammars.check(spec)
    except GrammarError as error:
        raise BadRequest(f"{field}: {error}", field=field) from None
    return lambda: grammars.constraint(spec)


class Choices:
    """n choices for one prompt on one swarm session: the prompt runs once, each next choice rewinds to it.

    The session opens here, before the reply starts, and is the request's until `run` has closed it: whatever
    ends the request first (a later prompt refused, an error, a client gone) closes it (see held_sessions.py)."""

    def __init__(self, engine: Engine, model: ServedModel, prompt_ids: list[int], max_tokens: int, n: int):
        self.engine, self.model, self.prompt_ids, self.n = engine, model, prompt_ids, n
        self.session = engine.open_session(model.name, len(prompt_ids) + max_tokens, expires=False, owner=client_id())
        held_sessions.hold(self)

    def close(self) -> None:
        """Free the session's slot and the servers' caches; a no-op once `run` has done so."""
        self.engine.close_session(self.session)

    def run(self, make_request: Callable[[int], GenerationRequest], cancelled, stats) -> Iterator[tuple[int, Delta]]:
        engine, session = self.engine, self.session
        try:
            with engine.sessions.use(session.id):
                for index in range(self.n):
                    if index:
                        engine.rewind(session, len(self.prompt_ids))
                    request_ = make_request(index)
                    if index == 0:
                        request_ = replace(request_, input_ids=tuple(self.prompt_ids))
                    for delta in engine.generate(session, request_, cancelled, stats):
                        yield index, delta
        finally:
            engine.close_session(session)


def collect(deltas: Iterator[tuple[int, Delta]], n: int) -> list[tuple[str, str, list, int]]:
    """(text, finish_reason, logprobs, token count) of each choice."""
    texts, finishes, logprobs, counts = [""] * n, ["stop"] * n, [[] for _ in range(n)], [0] * n
    for index, delta in deltas:
        texts[index] += delta.text
        logprobs[index] += delta.logprobs
        counts[index] += delta.token_count
        if delta.finish_reason:
            finishes[index] = delta.finish_reason
    return list(zip(texts, finishes, logprobs, counts))
