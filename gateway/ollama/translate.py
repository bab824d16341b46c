"""Ollama's request fields converted once into chat's terms: `options` into SamplingFields (so that chat/params.py
turns them into SamplingParams, a token budget and stops, exactly as it does for OpenAI's requests), `format` into a
response_format, messages into ChatMessages for chat/prompts.py; then a reply planned (plan_reply).

    options.temperature, top_k, top_p, min_p, typical_p   the same names
    options.repeat_penalty                                 repetition_penalty
    options.presence_penalty, frequency_penalty            the same names
    options.mirostat, mirostat_tau, mirostat_eta           the same names
    options.seed                                           seed (a negative one: none, a fresh random reply)
    options.num_predict                                    max_tokens (-1, -2 and 0: whatever the context leaves)
    options.stop                                           stop
    format "json" / a JSON schema                          response_format json_object / json_schema
"""

from __future__ import annotations

import json
from typing import Optional

from gateway.chat.params import NO_TOOLS, ToolChoice, compiled_constraint, requested_constraint
from gateway.chat.plan import Plan, chat_prompt_ids, plan_generation
from gateway.chat.reasoning import NO_THINKING, reply_thinking, template_kwargs, template_thinks
from gateway.chat.schemas import ChatMessage, FunctionCall, JsonSchemaFormat, ResponseFormat, SamplingFields, ToolCall
from gateway.engine.generation import Engine
from gateway.engine.lengths import check_new_tokens
from gateway.engine.served import ServedModel
from gateway.errors import BadRequest
from gateway.ollama.schemas import OllamaMessage, OllamaOptions


def sampling_fields(fields, max_new_tokens: int) -> SamplingFields:
    """An Ollama chat or generate request's sampling, as the OpenAI API's fields (one reply: n is 1)."""
    options = fields.options or OllamaOptions()
    num_predict = options.num_predict if options.num_predict and options.num_predict > 0 else None
    check_new_tokens("options.num_predict", num_predict, max_new_tokens)
    return SamplingFields(
        model=fields.model, temperature=options.temperature, top_k=options.top_k, top_p=options.top_p,
        min_p=options.min_p, typical_p=options.typical_p, repetition_penalty=options.repeat_penalty,
        presence_penalty=options.presence_penalty, frequency_penalty=options.frequency_penalty,
        mirostat=options.mirostat, mirostat_tau=options.mirostat_tau, mirostat_eta=options.mirostat_eta,
        seed=options.seed if options.seed is not None and options.seed >= 0 else None,
        stop=options.stop, max_tokens=num_predict, response_format=response_format(fields.format))


def response_format(format_) -> Optional[ResponseFormat]:
    """Ollama's `format`. A schema is read as Ollama reads it (not OpenAI's strict mode): keywords the grammar
    engine does not know are ignored, and an object without additionalProperties may have others."""
    if format_ is None:
        return None
    if format_ == "json":
        return ResponseFormat(type="json_object")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=format_, strict=False))


def plan_reply(engine: Engine, model: ServedModel, fields, prompt_ids: list[int], param: str, logprobs: Optional[int],
               tool_choice: ToolChoice = NO_TOOLS, templated: bool = True) -> Plan:
    """Check everything and open the session (before any line is sent), as the OpenAI API does; a `format` the
    grammar engine cannot compile is a 400 that names it (compiled once: the model caches it). A prompt in the
    model's chat template (`templated`) gets a thinking model's reasoning told apart (chat/reasoning.py)."""
    sampling = sampling_fields(fields, engine.limits.max_new_tokens)
    if sampling.response_format is not None and not tool_choice.forced:  # a forced call has its grammar, not format's
        compiled_constraint(model, requested_constraint(sampling), field="format")
    thinking = reply_thinking(model.tokenizer, prompt_ids, requested_think(fields)) if templated else NO_THINKING
    return plan_generation(engine, model, sampling, prompt_ids, param, tool_choice, logprobs, thinking)


def requested_think(fields) -> Optional[bool]:
    """`think` as the template's switch: false off, true or an effort on, absent the template's default."""
    return None if fields.think is None else fields.think is not False


def chat_messages(messages: list[OllamaMessage]) -> list[ChatMessage]:
    """Ollama's messages as the ChatMessages prompts.render_chat takes (tool calls' arguments as JSON text)."""
    converted = []
    for index, message in enumerate(messages):
        refuse_images(message.images, f"messages[{index}].images")
        calls = [ToolCall(function=FunctionCall(name=call.function.name, arguments=json.dumps(call.function.arguments)))
                 for call in message.tool_calls or []]
        converted.append(ChatMessage(role=message.role, content=message.content or "", name=message.tool_name,
                                     tool_calls=calls or None))
    return converted


def refuse_images(images: Optional[list[str]], field: str) -> None:
    if images:
        raise BadRequest(f"{field}: the served models take text only", field=field)


def refuse_unsupported(fields, model: ServedModel) -> None:
    """What Ollama refuses of a model that cannot do it: thinking (of a template that does not think), and
    /api/generate's suffix (fill in the middle); and what only Ollama's own runtime can do: Go templates."""
    model_name = model.name
    if requested_think(fields) and not template_thinks(model.tokenizer.chat_template):
        raise BadRequest(f"think: {model_name!r} does not support thinking", field="think")
    if getattr(fields, "suffix", None):
        raise BadRequest(f"suffix: {model_name!r} does not support insert", field="suffix")
    if getattr(fields, "template", None):
        raise BadRequest("template: Ollama's Go templates are not run here; send raw: true and a prompt formatted "
                         "as the model expects", field="template")
    refuse_images(getattr(fields, "images", None), "images")


def generate_prompt_ids(model: ServedModel, fields) -> list[int]:
    """/api/generate's prompt as token ids: an earlier reply's `context`, then the prompt; in the model's chat
    template with `system` (as Ollama does), or as it is with `raw` or when the model has no template."""
    context = list(fields.context or [])
    model.check_token_ids(context, "context")
    if not templated(model, fields):
        return context + model.encode(fields.prompt, at_start=not context)
    messages = [ChatMessage(role="system", content=fields.system)] if fields.system else []
    messages.append(ChatMessage(role="user", content=fields.prompt))
    return context + chat_prompt_ids(model, messages, None, template_kwargs=template_kwargs(requested_think(fields)))


def templated(model: ServedModel, fields) -> bool:
    """/api/generate's prompt goes into the model's chat template (not with `raw`, nor for a model without one)."""
    return not fields.raw and bool(model.tokenizer.chat_template)
