"""The choices of one OpenAI request, planned and run: the lengths checked and the per-choice GenerationRequests
built (before any stream starts), then n choices for one prompt on one swarm session, and their deltas collected.

    choices, make_request = plan_generation(engine, model, fields, prompt_ids, "messages", logprobs=top)
    for index, delta in choices.run(make_request, cancelled, stats): ...   # streamed
    collect(choices.run(make_request, lambda: False, stats), n)           # whole replies
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator

from gateway.access import client_id
from gateway.engine import Delta, Engine, GenerationRequest, ServedModel
from gateway.errors import BadRequest
from gateway.limits import check_context_length
from gateway.openai_params import constraint_spec, max_new_tokens, sampling_params, stop_fields


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
    spec = constraint_spec(fields, tool_choice)
    constraint = None
    if spec is not None:
        from gateway.grammar import GrammarError

        grammars = model.grammars()
        try:
            grammars.check(spec)
        except GrammarError as error:
            forced_call = tool_choice is not None and tool_choice[0] not in ("auto", "none")
            field = "tools" if forced_call else "response_format" if fields.response_format else "grammar"
            raise BadRequest(f"{field}: {error}", field=field) from None
        constraint = lambda: grammars.constraint(spec)

    def make_request(index: int) -> GenerationRequest:
        seed = None if sampling.seed is None else sampling.seed + index  # n different, reproducible choices
        return GenerationRequest(
            inputs=None, sampling=replace(sampling, seed=seed), max_new_tokens=max_tokens,
            stop_sequences=tuple(stop_sequences), include_stop=False, stop_token_ids=tuple(stop_token_ids),
            constraint=constraint, **extra)

    return Choices(engine, model, prompt_ids, max_tokens, fields.n), make_request


class Choices:
    """n choices for one prompt on one swarm session: the prompt runs once, each next choice rewinds to it."""

    def __init__(self, engine: Engine, model: ServedModel, prompt_ids: list[int], max_tokens: int, n: int):
        self.engine, self.model, self.prompt_ids, self.n = engine, model, prompt_ids, n
        self.session = engine.open_session(model.name, len(prompt_ids) + max_tokens, expires=False, owner=client_id())

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
