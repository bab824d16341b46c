"""A chat-shaped request planned: everything checked and its swarm session open before any reply starts, so that a
refusal (400, 429, 503) is a status rather than an event in a stream.

    prompt_ids = chat_prompt_ids(model, messages, tool_choice.tools)        # a chat: messages rendered first
    plan = plan_generation(engine, model, fields, prompt_ids, "messages", tool_choice, logprobs=top)
    for index, delta in plan.run(cancelled, stats): ...                    # n choices on one session

reply.py sums the deltas into replies; each dialect only formats them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional

from gateway.chat.params import (
    NO_TOOLS,
    ToolChoice,
    compiled_constraint,
    max_new_tokens,
    requested_constraint,
    sampling_params,
    stop_fields,
)
from gateway.chat.prompts import render_chat
from gateway.chat.reasoning import NO_THINKING, Thinking
from gateway.chat.schemas import ChatMessage, SamplingFields, Tool
from gateway.engine.generation import Delta, Engine, GenerationRequest
from gateway.engine.lengths import check_context_length
from gateway.engine.served import GatewaySession, ServedModel
from gateway.errors import BadRequest
from gateway.web import held_sessions
from gateway.web.access import client_id


def chat_prompt_ids(model: ServedModel, messages: list[ChatMessage], tools: Optional[list[Tool]],
                    continue_final: bool = False, template_kwargs: Optional[dict] = None) -> list[int]:
    """The prompt's token ids: the messages rendered with the model's chat template (see prompts.render_chat)."""
    prompt = render_chat(model.tokenizer, messages, tools, continue_final=continue_final,
                         template_kwargs=template_kwargs)
    return model.encode(prompt, at_start=False)  # the template wrote any special tokens itself


def plan_generation(engine: Engine, model: ServedModel, fields: SamplingFields, prompt_ids: list[int], param: str,
                    tool_choice: ToolChoice = NO_TOOLS, logprobs: Optional[int] = None,
                    thinking: Thinking = NO_THINKING) -> "Plan":
    """Check the lengths, the sampling fields and the grammar, then open the session. `param` is the field that the
    prompt came in (errors name it); `logprobs`: None for none, else how many alternatives each token comes with;
    `thinking`: how the replies' reasoning is told from their answers (reasoning.reply_thinking)."""
    config = model.config
    if not prompt_ids:
        raise BadRequest(f"{param}: must not be empty", field=param)
    max_tokens = max_new_tokens(fields, engine.limits.max_new_tokens, config.max_session_length - len(prompt_ids))
    check_context_length(config, len(prompt_ids), max_tokens, param)
    sampling = sampling_params(fields, config.defaults, model.vocab_size)
    stop_sequences, stop_token_ids = stop_fields(fields)
    constraint = compiled_constraint(model, requested_constraint(fields, tool_choice))
    request = GenerationRequest(
        inputs=None, sampling=sampling, max_new_tokens=max_tokens, stop_sequences=tuple(stop_sequences),
        include_stop=False, stop_token_ids=tuple(stop_token_ids), logprobs=logprobs, constraint=constraint)
    return Plan(engine, model, prompt_ids, request, fields.n, tool_choice.tools, fields.cache_salt or "", thinking)


@dataclass(eq=False)
class Plan:
    """n choices for one prompt: the prompt runs once, and the choices decode together on forks of its session.

    The session opens here, before the reply starts, and is the request's until `run` has closed it: whatever
    ends the request first (a later prompt refused, an error, a client gone) closes it (see web/held_sessions.py)."""

    engine: Engine
    model: ServedModel
    prompt_ids: list[int]
    request: GenerationRequest  # every choice's, but for its seed
    n: int
    tools: Optional[list[Tool]]  # a reply may call these (reply.py reads its calls as they come: tool_stream.py)
    cache_salt: str = ""  # the client's own separation of its cached conversations (see engine/warm.py)
    thinking: Thinking = NO_THINKING  # a thinking model's reasoning is told apart from its answer (reasoning.py)
    session: GatewaySession = field(init=False)
    cached_tokens: int = field(init=False)  # of the prompt, in the servers' caches already: never computed again

    def __post_init__(self):
        max_length = len(self.prompt_ids) + self.request.max_new_tokens
        self.session, self.cached_tokens = self.engine.open_for_prompt(self.model, self.prompt_ids, max_length,
                                                                       client_id(), self.cache_salt, self.n)
        self._given_back = threading.Lock()  # held once the session is given back: it is then another request's
        held_sessions.hold(self)

    def close(self) -> None:
        """Give the session back (kept warm for the client's next request, or closed); a no-op once `run` has."""
        if self._given_back.acquire(blocking=False):
            self.engine.finish_session(self.session)

    def request_for(self, index: int) -> GenerationRequest:
        """Choice `index`'s request: the first one sends the prompt past what the servers hold; seeds differ, so n
        choices differ reproducibly."""
        sampling = self.request.sampling
        seed = None if sampling.seed is None else sampling.seed + index
        request = replace(self.request, sampling=replace(sampling, seed=seed))
        return replace(request, input_ids=tuple(self.prompt_ids[self.cached_tokens:])) if index == 0 else request

    def run(self, cancelled: Callable[[], bool], stats) -> Iterator[tuple[int, Delta]]:
        """(choice index, delta) of every choice in turn; the session is given back at the end, however it comes."""
        engine, session = self.engine, self.session
        try:
            with engine.use_session(session.id):
                if self.n == 1:
                    for delta in engine.generate(session, self.request_for(0), cancelled, stats):
                        yield 0, delta
                else:  # forks of one prefill, decoded together
                    yield from engine.generate_choices(session, [self.request_for(index) for index in range(self.n)],
                                                       cancelled, stats)
        finally:
            self.close()
