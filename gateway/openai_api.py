"""The OpenAI-compatible API (a superset of MLC-LLM's, mistral.rs's and Ai00's): thin translators to the engine.

The blueprint is registered under PREFIXES (OpenAI's /v1, and Ai00's /api/oai and /api/oai/v1); `extras` holds
the routes that live at the root (/tokenize, /detokenize, /stats, /verbose_stats). Errors in OpenAI's envelope
come from create_app's one error handler, which asks `speaks_openai` which shape a request gets.
"""

from __future__ import annotations

import base64
import logging
import struct
from dataclasses import replace
from typing import Callable, Iterator, Optional

from flask import Blueprint, jsonify, request

from gateway import openai_format as wire
from gateway.access import client_id
from gateway.engine import Delta, Engine, GenerationRequest, ServedModel
from gateway.errors import BadRequest
from gateway.http_api import get_engine
from gateway.limits import check_context_length
from gateway.openai_params import constraint_spec, max_new_tokens, sampling_params, stop_fields
from gateway.prompts import parse_tool_calls, render_chat
from gateway.schemas import (
    ChatCompletionRequest,
    ChooseRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    load_json,
    parse,
)
from gateway.sse import event_stream

logger = logging.getLogger(__name__)
blueprint = Blueprint("openai", __name__)
extras = Blueprint("openai_extras", __name__)
PREFIXES = ("/v1", "/api/oai", "/api/oai/v1")
_unknown_fields_logged: set[str] = set()
UNKNOWN_FIELDS_REMEMBERED = 1000  # the names are the clients' to choose: a bound on memory and on the log


def speaks_openai() -> bool:
    """Whether this request's errors take OpenAI's envelope: its routes, and unknown paths under its prefixes."""
    if request.blueprint is not None:
        return request.blueprint.startswith("openai")
    return request.path.startswith(tuple(prefix + "/" for prefix in PREFIXES))


def json_body(schema):
    if not request.is_json:
        raise BadRequest("the body must be a JSON object (Content-Type: application/json)")
    fields = parse(schema, load_json(request.get_data()))
    for name in (fields.model_extra or {}):  # accepted and ignored, as vLLM does; said once per field name
        if name not in _unknown_fields_logged and len(_unknown_fields_logged) < UNKNOWN_FIELDS_REMEMBERED:
            _unknown_fields_logged.add(name)
            logger.info("ignoring unknown request field %.80r", name)
    return fields


# ------------------------------------------------------------------------------------------ generation


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


# ------------------------------------------------------------------------------------------ chat


@blueprint.post("/chat/completions")
def chat_completions():
    fields = json_body(ChatCompletionRequest)
    engine = get_engine()
    model = engine.model(fields.model)
    tool_choice = fields.tool_choice or ("auto" if fields.tools else "none")
    if tool_choice != "none" and not fields.tools:
        raise BadRequest("tool_choice: needs tools", field="tool_choice")
    tools = fields.tools if tool_choice != "none" else None
    prompt = render_chat(model.tokenizer, fields.messages, tools)
    prompt_ids = model.encode(prompt, at_start=False)  # the template wrote any special tokens itself
    top = (fields.top_logprobs or 0) if fields.logprobs else None
    choices, make_request = plan_generation(engine, model, fields, prompt_ids, "messages", logprobs=top,
                                            tool_choice=(tool_choice, tools, fields.parallel_tool_calls))
    stats = engine.stats.begin()
    # with tools and a free choice, a reply is a tool call or text: known only at its end
    whole_replies = tools is not None
    tokenizer, request_id = model.tokenizer, wire.new_id("chatcmpl")

    def finish(text: str, finish_reason: str):
        calls = parse_tool_calls(text, tools) if tools else None
        if calls:
            return None, [wire.tool_call(name, arguments) for name, arguments in calls], "tool_calls"
        return text, None, finish_reason

    if not fields.stream:
        replies = collect(choices.run(make_request, lambda: False, stats), fields.n)
        results = []
        for index, (text, finish_reason, logprobs, _) in enumerate(replies):
            content, calls, finish_reason = finish(text, finish_reason)
            chat_logprobs = wire.chat_logprobs(tokenizer, logprobs) if top is not None else None
            results.append(wire.chat_choice(index, content, finish_reason, chat_logprobs, calls))
        usage = wire.usage(len(prompt_ids), sum(reply[3] for reply in replies), stats.timing())
        return jsonify(wire.chat_completion(request_id, model.name, results, usage))

    include_usage = bool(fields.stream_options and fields.stream_options.include_usage)

    def events(cancelled):
        chunk = lambda index, delta, **kw: wire.chat_chunk(request_id, model.name, index, delta,
                                                           with_usage_field=include_usage, **kw)
        texts, started = {}, set()
        for index, delta in choices.run(make_request, cancelled, stats):
            if index not in started:
                started.add(index)
                yield chunk(index, {"role": "assistant", "content": ""})
            texts[index] = texts.get(index, "") + delta.text
            logprobs = wire.chat_logprobs(tokenizer, delta.logprobs) if top is not None and delta.logprobs else None
            if not whole_replies and (delta.text or logprobs):
                yield chunk(index, {"content": delta.text}, logprobs=logprobs)
            if delta.finish_reason:
                finish_reason = delta.finish_reason
                if whole_replies:
                    content, calls, finish_reason = finish(texts[index], finish_reason)
                    if calls:
                        yield chunk(index, {"tool_calls": [{"index": number, **call} for number, call in enumerate(calls)]})
                    else:
                        yield chunk(index, {"content": content})
                yield chunk(index, {}, finish_reason=finish_reason)
        if include_usage:
            usage = wire.usage(len(prompt_ids), stats.completion_tokens, stats.timing())
            yield wire.usage_chunk(request_id, model.name, "chat.completion.chunk", usage)

    return event_stream(events, wire.error_body)


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


# ------------------------------------------------------------------------------------------ completions


def prompt_token_lists(model: ServedModel, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [model.encode(prompt, at_start=True)]
    if prompt and all(isinstance(item, int) for item in prompt):
        lists = [list(prompt)]
    elif prompt and all(isinstance(item, list) for item in prompt):
        lists = [list(item) for item in prompt]
    else:
        lists = [model.encode(item, at_start=True) for item in prompt]
    if not lists:
        raise BadRequest("prompt: must not be empty", field="prompt")
    for ids in lists:
        if any(not 0 <= token < model.vocab_size for token in ids):
            raise BadRequest(f"prompt: token ids must be in [0, {model.vocab_size})", field="prompt")
    return lists


@blueprint.post("/completions")
def completions():
    fields = json_body(CompletionRequest)
    engine = get_engine()
    model = engine.model(fields.model)
    tokenizer, request_id = model.tokenizer, wire.new_id("cmpl")
    top = fields.logprobs
    prompts = prompt_token_lists(model, fields.prompt)
    if len(prompts) > engine.sessions.max_per_client:  # each prompt holds a session of its own while it runs
        raise BadRequest(f"prompt: at most {engine.sessions.max_per_client} prompts in one request "
                         "(MAX_SESSIONS_PER_CLIENT)", field="prompt")
    plans = [(ids, *plan_generation(engine, model, fields, ids, "prompt", logprobs=top)) for ids in prompts]
    stats = engine.stats.begin()
    prompt_tokens = sum(len(ids) for ids, _, _ in plans)

    def echo(ids: list[int]) -> tuple[str, list]:
        """The prompt's text, and its tokens' logprobs when asked for, to prepend to each choice."""
        if not fields.echo:
            return "", []
        return tokenizer.decode(ids), engine.token_logprobs(model.name, ids, top) if top is not None else []

    def logprobs_of(prefix_ids: list[int], prefix_items: list, generated) -> Optional[dict]:
        if top is None:
            return None
        token_ids = prefix_ids + [item.token_id for item in generated]
        return wire.completion_logprobs(tokenizer, prefix_items + list(generated), token_ids) if token_ids else None

    if not fields.stream:
        results = []
        for number, (ids, choices, make_request) in enumerate(plans):
            echo_text, echoed = echo(ids)
            for index, (text, finish_reason, logprobs, _) in enumerate(
                    collect(choices.run(make_request, lambda: False, stats), fields.n)):
                logprobs = logprobs_of(ids if fields.echo else [], echoed, logprobs)
                results.append(wire.text_choice(number * fields.n + index, echo_text + text, finish_reason, logprobs))
        usage = wire.usage(prompt_tokens, stats.completion_tokens, stats.timing())
        return jsonify(wire.text_completion(request_id, model.name, results, usage))

    include_usage = bool(fields.stream_options and fields.stream_options.include_usage)

    def events(cancelled):
        for number, (ids, choices, make_request) in enumerate(plans):
            echo_text, echoed = echo(ids)
            started = set()
            for index, delta in choices.run(make_request, cancelled, stats):
                text, prefix_ids, prefix_items = delta.text, [], []
                if index not in started:  # a choice's first chunk carries the echoed prompt
                    started.add(index)
                    text, prefix_ids, prefix_items = echo_text + text, ids if fields.echo else [], echoed
                choice = wire.text_choice(number * fields.n + index, text, delta.finish_reason,
                                          logprobs_of(prefix_ids, prefix_items, delta.logprobs))
                if text or delta.finish_reason or choice["logprobs"]:
                    yield wire.text_chunk(request_id, model.name, choice, with_usage_field=include_usage)
        if include_usage:
            usage = wire.usage(prompt_tokens, stats.completion_tokens, stats.timing())
            yield wire.usage_chunk(request_id, model.name, "text_completion", usage)

    return event_stream(events, wire.error_body)


# ------------------------------------------------------------------------------------------ the rest


@blueprint.get("/models")
def models():
    data = [{"id": model["name"], "object": "model", "created": 0, "owned_by": "swarm",
             "max_model_len": model["max_session_length"]} for model in get_engine().listed_models()]
    return jsonify(object="list", data=data)


@blueprint.post("/embeddings")
def embeddings():
    fields = json_body(EmbeddingRequest)
    engine = get_engine()
    model = engine.model(fields.model)
    if fields.input == "" or fields.input == []:
        raise BadRequest("input: must not be empty", field="input")
    token_lists = prompt_token_lists(model, fields.input)
    for ids in token_lists:
        if not ids:
            raise BadRequest("input: must not be empty", field="input")
        check_context_length(model.config, len(ids), 0, "input")
    data = []
    for index, ids in enumerate(token_lists):
        vector = engine.embed(model.name, ids, fields.layer)
        if fields.dimensions:
            vector = vector[: fields.dimensions]
        if fields.encoding_format == "base64":
            vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": vector})
    tokens = sum(len(ids) for ids in token_lists)
    return jsonify(object="list", data=data, model=model.name,
                   usage={"prompt_tokens": tokens, "total_tokens": tokens})


@blueprint.post("/chooses")
def chooses():
    """Ai00: rank choices as continuations of the input by perplexity, best (lowest) first."""
    import math

    fields = json_body(ChooseRequest)
    engine = get_engine()
    model = engine.model(fields.model)
    context = model.encode("".join([fields.input] if isinstance(fields.input, str) else fields.input), at_start=True)
    scored = []
    for index, choice in enumerate(fields.choices):
        continuation = model.encode(choice, at_start=False)
        if not continuation:
            raise BadRequest(f"choices[{index}]: must not be empty", field=f"choices[{index}]")
        check_context_length(model.config, len(context) + len(continuation), 0, f"choices[{index}]")
        logprobs = engine.token_logprobs(model.name, context + continuation)[len(context):]
        if not context:
            logprobs = logprobs[1:] or logprobs  # the very first token has no context to be scored against
        values = [item.logprob for item in logprobs if item is not None]
        scored.append((math.exp(-sum(values) / max(len(values), 1)), index, choice))
    ranked = sorted(scored)
    data = [{"object": "choice", "index": index, "rank": rank, "choice": choice, "perplexity": perplexity}
            for rank, (perplexity, index, choice) in enumerate(ranked)]
    return jsonify(object="list", data=data, model=model.name)


@extras.post("/tokenize")
def tokenize():
    fields = json_body(TokenizeRequest)
    model = get_engine().model(fields.model)
    if fields.messages:
        tokens = model.encode(render_chat(model.tokenizer, fields.messages, None), at_start=False)
    else:
        text = next((value for value in (fields.prompt, fields.text, fields.content) if value is not None), None)
        if text is None:
            raise BadRequest("prompt: give prompt (or text, content, messages)", field="prompt")
        tokens = model.tokenizer(text, add_special_tokens=fields.add_special_tokens)["input_ids"]
    return jsonify(tokens=tokens, count=len(tokens), max_model_len=model.config.max_session_length)


@extras.post("/detokenize")
def detokenize():
    fields = json_body(DetokenizeRequest)
    model = get_engine().model(fields.model)
    if any(not 0 <= token < model.vocab_size for token in fields.tokens):
        raise BadRequest(f"tokens: ids must be in [0, {model.vocab_size})", field="tokens")
    text = model.tokenizer.decode(fields.tokens)
    return jsonify(prompt=text, content=text)


@extras.get("/stats")
def stats():
    return jsonify(get_engine().stats.summary())


@extras.get("/verbose_stats")
def verbose_stats():
    return jsonify(get_engine().stats.verbose())
