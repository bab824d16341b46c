"""Chat-style request fields (OpenAI's, with MLC's, mistral.rs's and Ai00's) converted once into the engine's terms:
SamplingParams, a token budget, stop sequences and stop tokens, logprobs, the tools a reply may call, and the grammar
that constrains it. Every chat-shaped dialect (OpenAI, Responses, Anthropic, Ollama) reaches the engine through here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

from config import GenerationDefaults
from gateway.chat.schemas import MAX_LOGIT_BIAS, NamedToolChoice, SamplerOverride, SamplingFields, Tool
from gateway.engine.lengths import check_new_tokens
from gateway.engine.sampling import SamplingParams
from gateway.errors import BadRequest


@dataclass(frozen=True)
class ToolChoice:
    """Which tools a reply may call, and how: "none" (the tools are not even shown to the model), "auto" (a call or
    text, the model's choice), "required" (one call at least) or a named function (that call)."""

    mode: Union[str, NamedToolChoice] = "none"
    tools: Optional[list[Tool]] = None  # shown to the model; None with mode "none"
    parallel: bool = True  # a forced call may be several

    @property
    def forced(self) -> bool:
        """A call is required (by name or not): a grammar holds the reply to it."""
        return self.mode not in ("auto", "none")


NO_TOOLS = ToolChoice()


def offered_tools(mode, tools: Optional[list[Tool]], parallel: bool = True) -> ToolChoice:
    """A request's tool_choice and tools: by default "auto" with tools, else "none"."""
    mode = mode or ("auto" if tools else "none")
    if mode != "none" and not tools:
        raise BadRequest("tool_choice: needs tools", field="tool_choice")
    return ToolChoice(mode, tools if mode != "none" else None, parallel)


def requested_top_logprobs(fields) -> Optional[int]:
    """How many alternatives each token's logprob comes with (None: no logprobs), from `logprobs` and `top_logprobs`."""
    return (fields.top_logprobs or 0) if fields.logprobs else None


def _pick(value, default):
    return default if value is None else value


def sampling_params(fields: SamplingFields, defaults: GenerationDefaults, vocab_size: int) -> SamplingParams:
    values = dict(
        temperature=_pick(fields.temperature, defaults.temperature),
        top_k=max(_pick(fields.top_k, defaults.top_k), 0),
        top_p=_pick(fields.top_p, defaults.top_p),
        min_p=_pick(fields.min_p, 0.0),
        typical_p=_pick(fields.typical_p, 1.0),
        repetition_penalty=_pick(fields.repetition_penalty, defaults.repetition_penalty),
        presence_penalty=_pick(fields.presence_penalty, 0.0),
        frequency_penalty=_pick(fields.frequency_penalty, 0.0),
        penalty_decay=_pick(fields.penalty_decay, 1.0),
        logit_bias=logit_bias(fields, vocab_size),
        mirostat=_pick(fields.mirostat, 0),
        mirostat_tau=_pick(fields.mirostat_tau, 5.0),
        mirostat_eta=_pick(fields.mirostat_eta, 0.1),
        seed=fields.seed,
    )
    override = fields.sampler_override or fields.sampler
    if override is not None:
        values.update(ai00_sampler(override))
    return SamplingParams(do_sample=values["temperature"] > 0, **values)  # OpenAI: temperature 0 is greedy


def ai00_sampler(override: SamplerOverride) -> dict:
    """Ai00's sampler_override in our terms. `penalty` is a half-life in tokens: a decay of 0.5 ** (1 / penalty)."""
    values = {name: getattr(override, name) for name in ("temperature", "top_k", "top_p", "presence_penalty",
                                                          "frequency_penalty", "penalty_decay")
              if getattr(override, name) is not None}
    if override.penalty is not None and override.penalty_decay is None:
        values["penalty_decay"] = 0.5 ** (1.0 / override.penalty)
    if override.type == "Mirostat":
        values.update(mirostat=2, mirostat_tau=_pick(override.tau, 5.0), mirostat_eta=_pick(override.rate, 0.1))
    elif override.type == "Typical":
        values["typical_p"] = min(_pick(override.tau, 0.95), 1.0)
    return values


def logit_bias(fields: SamplingFields, vocab_size: int) -> tuple[tuple[int, float], ...]:
    merged = {**(fields.bias or {}), **(fields.logit_bias or {})}
    if len(merged) > MAX_LOGIT_BIAS:
        raise BadRequest(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens (logit_bias and bias together), got "
                         f"{len(merged)}", field="logit_bias")
    for token, bias in merged.items():
        if not 0 <= token < vocab_size:
            raise BadRequest(f"logit_bias: token id {token} is not in [0, {vocab_size})", field="logit_bias")
        if not -100 <= bias <= 100:
            raise BadRequest(f"logit_bias: bias {bias} for token {token} is not in [-100, 100]", field="logit_bias")
    return tuple(sorted(merged.items()))


def max_new_tokens(fields: SamplingFields, cap: int, remaining: int) -> int:
    """The completion's token budget: as asked (under the gateway's cap), else whatever context remains."""
    for name in ("max_completion_tokens", "max_tokens", "max_gen_len"):
        value = getattr(fields, name)
        if value is not None:
            check_new_tokens(name, value, cap)
            return value
    return max(min(cap, remaining), 1)


def stop_fields(fields: SamplingFields) -> tuple[list[str], list[int]]:
    stops = [fields.stop] if isinstance(fields.stop, str) else list(fields.stop or [])
    strings = [stop for stop in stops if isinstance(stop, str) and stop]
    token_ids = [stop for stop in stops if isinstance(stop, int)] + list(fields.stop_token_ids or [])
    return strings, token_ids


def constraint_spec(fields: SamplingFields, tool_choice: ToolChoice = NO_TOOLS):
    """The grammar spec that constrains the reply, if any (see requested_constraint)."""
    requested = requested_constraint(fields, tool_choice)
    return requested[0] if requested else None


def requested_constraint(fields: SamplingFields, tool_choice: ToolChoice = NO_TOOLS):
    """(spec, field) of the grammar that constrains the reply, if any: a forced tool call, else the structured
    output that the request asks for (structured.py)."""
    from gateway.chat.structured import requested_spec
    from gateway.engine.grammar import tool_call_spec

    if tool_choice.forced:
        mode = tool_choice.mode
        if isinstance(mode, NamedToolChoice):
            name = mode.function.get("name")
            if name not in {tool.function.name for tool in tool_choice.tools}:
                raise BadRequest(f"tool_choice: no tool is named {name!r}", field="tool_choice")
            mode = {"type": "function", "function": {"name": name}}
        tools = [tool.model_dump(exclude_none=True) for tool in tool_choice.tools]
        spec = tool_call_spec(tools, mode, tool_choice.parallel)
        # the call is ours to format: single spaces at most, so no model can wander in blank space
        return replace(spec, value={**spec.value, "x-guidance": {"whitespace_pattern": "[ ]"}}), "tools"
    return requested_spec(fields)


def compiled_constraint(model, requested, field: Optional[str] = None):
    """What makes each choice's grammar constraint (None for no constraint), once its spec compiled: a spec the
    grammar engine refuses is a 400 naming its field (`field` overrides the one the spec came from)."""
    if requested is None:
        return None
    from gateway.engine.grammar import GrammarError

    spec, spec_field = requested
    field = field or spec_field
    grammars = model.grammars()  # engine.served.ServedModel's, built on first use
    try:
        grammars.check(spec)
    except GrammarError as error:
        raise BadRequest(f"{field}: {error}", field=field) from None
    return lambda: grammars.constraint(spec)
