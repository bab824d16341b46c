"""The OpenAI-compatible API (a superset of MLC-LLM's, mistral.rs's and Ai00's): thin translators to the engine.

The blueprint is registered under PREFIXES (OpenAI's /v1, and Ai00's /api/oai and /api/oai/v1); `extras` holds
the routes that live at the root (/tokenize, /detokenize, /stats, /verbose_stats). Errors in OpenAI's envelope
come from create_app's one error handler, which asks `speaks_openai` which shape a request gets.
"""

from __future__ import annotations

import base64
import struct
from typing import Iterator, Optional

from flask import Blueprint, jsonify, request

from gateway import openai_format as wire
from gateway.current_engine import get_engine
from gateway.engine import Engine, ServedModel
from gateway.errors import BadRequest
from gateway.json_bodies import json_body
from gateway.limits import check_context_length
from gateway.openai_choices import collect, plan_chat, plan_generation
from gateway.prompts import parse_tool_calls, render_chat
from gateway.schemas import (
    ChatCompletionRequest,
    ChooseRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from gateway.sse import event_stream

blueprint = Blueprint("openai", __name__)
extras = Blueprint("openai_extras", __name__)
PREFIXES = ("/v1", "/api/oai", "/api/oai/v1")


def speaks_openai() -> bool:
    """Whether this request's errors take OpenAI's envelope: its routes, and unknown paths under its prefixes."""
    if request.blueprint is not None:
        return request.blueprint.startswith("openai")
    return request.path.startswith(tuple(prefix + "/" for prefix in PREFIXES))


# ------------------------------------------------------------------------------------------ chat


@blueprint.post("/chat/completions")
def chat_completions():
    fields = json_body(ChatCompletionRequest)
    engine = get_engine()
    top = (fields.top_logprobs or 0) if fields.logprobs else None
    model, tools, prompt_ids, plan = plan_chat(engine, fields, logprobs=top)
    replies = ChatReplies(model, fields, tools, top, len(prompt_ids), plan, engine.stats.begin())
    if not fields.stream:
        return jsonify(replies.completion())
    return event_stream(replies.chunks, wire.error_body)


class ChatReplies:
    """A chat completion's n choices in OpenAI's wire format: one completion, or chunks as the deltas come."""

    def __init__(self, model: ServedModel, fields: ChatCompletionRequest, tools, top: Optional[int],
                 prompt_tokens: int, plan: tuple, stats):
        self.model, self.fields, self.tools, self.top, self.prompt_tokens = model, fields, tools, top, prompt_tokens
        self.choices, self.make_request = plan
        self.stats = stats
        # with tools and a free choice, a reply is a tool call or text: known only at its end, so streamed whole
        self.whole_replies = tools is not None
        self.request_id = wire.new_id("chatcmpl")
        self.include_usage = bool(fields.stream_options and fields.stream_options.include_usage)

    def completion(self) -> dict:
        replies = collect(self.choices.run(self.make_request, lambda: False, self.stats), self.fields.n)
        results = []
        for index, (text, finish_reason, logprobs, _) in enumerate(replies):
            content, calls, finish_reason = self.finish(text, finish_reason)
            results.append(wire.chat_choice(index, content, finish_reason, self.logprobs(logprobs), calls))
        usage = wire.usage(self.prompt_tokens, sum(reply[3] for reply in replies), self.stats.timing())
        return wire.chat_completion(self.request_id, self.model.name, results, usage)

    def chunks(self, cancelled) -> Iterator[dict]:
        texts, started = {}, set()
        for index, delta in self.choices.run(self.make_request, cancelled, self.stats):
            if index not in started:
                started.add(index)
                yield self.chunk(index, {"role": "assistant", "content": ""})
            texts[index] = texts.get(index, "") + delta.text
            logprobs = self.logprobs(delta.logprobs) if delta.logprobs else None
            if not self.whole_replies and (delta.text or logprobs):
                yield self.chunk(index, {"content": delta.text}, logprobs=logprobs)
            if delta.finish_reason:
                yield from self.last_chunks(index, texts[index], delta.finish_reason)
        if self.include_usage:
            usage = wire.usage(self.prompt_tokens, self.stats.completion_tokens, self.stats.timing())
            yield wire.usage_chunk(self.request_id, self.model.name, "chat.completion.chunk", usage)

    def last_chunks(self, index: int, text: str, finish_reason: str) -> Iterator[dict]:
        """A reply's end: the whole reply first when it was held back, then its finish_reason."""
        if self.whole_replies:
            content, calls, finish_reason = self.finish(text, finish_reason)
            if calls:
                numbered = [{"index": number, **call} for number, call in enumerate(calls)]
                yield self.chunk(index, {"tool_calls": numbered})
            else:
                yield self.chunk(index, {"content": content})
        yield self.chunk(index, {}, finish_reason=finish_reason)

    def finish(self, text: str, finish_reason: str):
        """(content, tool calls, finish_reason) of a whole reply: tool calls when the reply parses as them."""
        calls = parse_tool_calls(text, self.tools) if self.tools else None
        if calls:
            return None, [wire.tool_call(name, arguments) for name, arguments in calls], "tool_calls"
        return text, None, finish_reason

    def logprobs(self, items: list) -> Optional[dict]:
        return wire.chat_logprobs(self.model.tokenizer, items) if self.top is not None else None

    def chunk(self, index: int, delta: dict, **kw) -> dict:
        return wire.chat_chunk(self.request_id, self.model.name, index, delta,
                               with_usage_field=self.include_usage, **kw)


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
    prompts = prompt_token_lists(model, fields.prompt)
    if len(prompts) > engine.sessions.max_per_client:  # each prompt holds a session of its own while it runs
        raise BadRequest(f"prompt: at most {engine.sessions.max_per_client} prompts in one request "
                         "(MAX_SESSIONS_PER_CLIENT)", field="prompt")
    plans = [(ids, *plan_generation(engine, model, fields, ids, "prompt", logprobs=fields.logprobs)) for ids in prompts]
    replies = TextReplies(engine, model, fields, plans, engine.stats.begin())
    if not fields.stream:
        return jsonify(replies.completion())
    return event_stream(replies.chunks, wire.error_body)


class TextReplies:
    """A text completion's choices, n per prompt, in OpenAI's wire format: one completion, or chunks as the deltas
    come. With `echo`, each choice starts with its prompt (and with logprobs, the prompt tokens' logprobs)."""

    def __init__(self, engine: Engine, model: ServedModel, fields: CompletionRequest, plans: list[tuple], stats):
        self.engine, self.model, self.fields, self.plans, self.stats = engine, model, fields, plans, stats
        self.top = fields.logprobs
        self.request_id = wire.new_id("cmpl")
        self.prompt_tokens = sum(len(ids) for ids, _, _ in plans)
        self.include_usage = bool(fields.stream_options and fields.stream_options.include_usage)

    def completion(self) -> dict:
        n, results = self.fields.n, []
        for number, (ids, choices, make_request) in enumerate(self.plans):
            echo_text, echoed = self.echo(ids)
            for index, (text, finish_reason, logprobs, _) in enumerate(
                    collect(choices.run(make_request, lambda: False, self.stats), n)):
                logprobs = self.logprobs_of(ids if self.fields.echo else [], echoed, logprobs)
                results.append(wire.text_choice(number * n + index, echo_text + text, finish_reason, logprobs))
        usage = wire.usage(self.prompt_tokens, self.stats.completion_tokens, self.stats.timing())
        return wire.text_completion(self.request_id, self.model.name, results, usage)

    def chunks(self, cancelled) -> Iterator[dict]:
        for number, plan in enumerate(self.plans):
            yield from self.prompt_chunks(number, plan, cancelled)
        if self.include_usage:
            usage = wire.usage(self.prompt_tokens, self.stats.completion_tokens, self.stats.timing())
            yield wire.usage_chunk(self.request_id, self.model.name, "text_completion", usage)

    def prompt_chunks(self, number: int, plan: tuple, cancelled) -> Iterator[dict]:
        """The chunks of one prompt's n choices; a choice's first chunk carries the echoed prompt."""
        ids, choices, make_request = plan
        echo_text, echoed = self.echo(ids)
        started = set()
        for index, delta in choices.run(make_request, cancelled, self.stats):
            text, prefix_ids, prefix_items = delta.text, [], []
            if index not in started:
                started.add(index)
                text, prefix_ids, prefix_items = echo_text + text, ids if self.fields.echo else [], echoed
            choice = wire.text_choice(number * self.fields.n + index, text, delta.finish_reason,
                                      self.logprobs_of(prefix_ids, prefix_items, delta.logprobs))
            if text or delta.finish_reason or choice["logprobs"]:
                yield wire.text_chunk(self.request_id, self.model.name, choice, with_usage_field=self.include_usage)

    def echo(self, ids: list[int]) -> tuple[str, list]:
        """The prompt's text, and its tokens' logprobs when asked for, to prepend to each choice."""
        if not self.fields.echo:
            return "", []
        text = self.model.tokenizer.decode(ids)
        return text, self.engine.token_logprobs(self.model.name, ids, self.top) if self.top is not None else []

    def logprobs_of(self, prefix_ids: list[int], prefix_items: list, generated) -> Optional[dict]:
        if self.top is None:
            return None
        token_ids = prefix_ids + [item.token_id for item in generated]
        if not token_ids:
            return None
        return wire.completion_logprobs(self.model.tokenizer, prefix_items + list(generated), token_ids)


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
