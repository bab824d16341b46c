"""Ollama's API under /api (chat, generate, embed, embeddings, tags, show, ps, version): thin translators to the engine.

A request is read into its schema (schemas/ollama.py), translated once into the OpenAI API's SamplingFields
(ollama_params.py), planned and run by openai_choices on the one generation loop, and written in Ollama's wire
format (ollama_format.py): NDJSON lines unless `stream` is false. Errors are {"error": "..."} with Ollama's status
codes, from create_app's one error handler, which asks `speaks_ollama` which requests are Ollama's.
"""

from __future__ import annotations

import math
import time
from typing import Iterator, Optional

from flask import Blueprint, jsonify, request

from gateway import ollama_format as wire
from gateway.current_engine import get_engine
from gateway.engine import Engine, ServedModel
from gateway.errors import BadRequest, NotFound
from gateway.limits import check_context_length
from gateway.ndjson import ndjson_stream
from gateway.ollama_params import (
    chat_messages,
    check_format,
    generate_prompt_ids,
    offered_tools,
    refuse_unsupported,
    sampling_fields,
)
from gateway.openai_choices import collect, plan_generation
from gateway.prompts import parse_tool_calls, render_chat
from gateway.schemas import load_json, parse
from gateway.schemas.ollama import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)

blueprint = Blueprint("ollama", __name__, url_prefix="/api")
OTHER_APIS = ("/api/v1", "/api/v2", "/api/oai")  # Petals' HTTP and WebSocket APIs, Ai00's OpenAI prefix
LATEST = ":latest"  # Ollama's default tag: "tiny:latest" is "tiny"


def speaks_ollama() -> bool:
    """Whether this request's errors take Ollama's shape: its routes, and unknown paths under /api of no other API."""
    if request.blueprint is not None:
        return request.blueprint.startswith("ollama")
    return request.path.startswith("/api/") and not request.path.startswith(OTHER_APIS)


def json_fields(schema):
    """The body as `schema`. Ollama reads any body as JSON, whatever its Content-Type (curl -d sends a form's)."""
    return parse(schema, load_json(request.get_data()))


def load_model(engine: Engine, name: Optional[str]) -> tuple[ServedModel, float]:
    """The served model, and the seconds it took to connect it (0 once connected: Ollama's load_duration)."""
    began = time.perf_counter()
    try:
        model = engine.model(name)
    except NotFound:
        if not (name and name.endswith(LATEST)):
            raise
        model = engine.model(name[: -len(LATEST)])
    return model, time.perf_counter() - began


def respond(reply: "OllamaReply", stream: Optional[bool]):
    return jsonify(reply.whole()) if stream is False else ndjson_stream(reply.lines(), wire.error_body)


def respond_loaded(shape: str, model: ServedModel, fields):
    """Nothing to generate: Ollama's way to load a model (or to unload it, with keep_alive 0)."""
    body = wire.loaded(shape, model.name, unloaded=fields.keep_alive in (0, "0", "0s"))
    return jsonify(body) if fields.stream is False else ndjson_stream([body], wire.error_body)


# ------------------------------------------------------------------------------------------ generation


@blueprint.post("/chat")
def chat():
    fields = json_fields(OllamaChatRequest)
    engine = get_engine()
    stats = engine.stats.begin()  # its clock is the request's: total_duration
    model, load_seconds = load_model(engine, fields.model)
    refuse_unsupported(fields, model.name)
    if not fields.messages:
        return respond_loaded("chat", model, fields)
    tool_choice, tools = offered_tools(fields)
    prompt_ids = model.encode(render_chat(model.tokenizer, chat_messages(fields.messages), tools), at_start=False)
    top = (fields.top_logprobs or 0) if fields.logprobs else None
    # a forced call (tool_choice, this gateway's extension) is one call; a free choice may make several
    plan = plan_reply(engine, model, fields, prompt_ids, "messages", top, (tool_choice, tools, False))
    return respond(OllamaReply("chat", model, plan, stats, load_seconds, tools=tools, top=top), fields.stream)


@blueprint.post("/generate")
def generate():
    fields = json_fields(OllamaGenerateRequest)
    engine = get_engine()
    stats = engine.stats.begin()
    model, load_seconds = load_model(engine, fields.model)
    refuse_unsupported(fields, model.name)
    if not fields.prompt and not fields.system:
        return respond_loaded("generate", model, fields)
    prompt_ids = generate_prompt_ids(model, fields)
    top = (fields.top_logprobs or 0) if fields.logprobs else None
    # the generated tokens' ids come with their logprobs: asked for (0 alternatives) even when not shown, for `context`
    plan = plan_reply(engine, model, fields, prompt_ids, "prompt", 0 if top is None else top)
    reply = OllamaReply("generate", model, plan, stats, load_seconds, top=top, context=prompt_ids)
    return respond(reply, fields.stream)


def plan_reply(engine: Engine, model: ServedModel, fields, prompt_ids: list[int], param: str, logprobs: Optional[int],
               tool_choice: Optional[tuple] = None) -> tuple:
    """Check everything and open the session (before any line is sent), as the OpenAI API does."""
    sampling = sampling_fields(fields, engine.limits.max_new_tokens)
    forced_call = tool_choice is not None and tool_choice[0] not in ("auto", "none")  # its grammar, not format's
    if sampling.response_format is not None and not forced_call:
        check_format(model.grammars(), sampling)
    return plan_generation(engine, model, sampling, prompt_ids, param, logprobs=logprobs, tool_choice=tool_choice)


class OllamaReply:
    """One reply (Ollama has no n) in Ollama's wire format: whole, or a line per delta and a last line with the counts
    and durations. With tools offered the reply is held to its end: only then is it known to be a call or text."""

    def __init__(self, shape: str, model: ServedModel, plan: tuple, stats, load_seconds: float,
                 tools=None, top: Optional[int] = None, context: Optional[list[int]] = None):
        self.shape, self.model, self.stats, self.load_seconds = shape, model, stats, load_seconds
        self.choices, self.make_request = plan
        self.tools, self.top, self.prompt_ids = tools, top, context
        self.generated_ids: list[int] = []

    def whole(self) -> dict:
        [(text, finish_reason, logprobs, _)] = collect(self.run(), 1)
        content, calls, finish_reason = self.finish(text, finish_reason)
        return wire.done(self.shape, self.model.name, content, finish_reason, self.durations(), tool_calls=calls,
                         logprobs=self.logprobs(logprobs), context=self.context())

    def lines(self) -> Iterator[dict]:
        text, finish_reason = "", "stop"
        for _, delta in self.run():
            text += delta.text
            logprobs = self.logprobs(delta.logprobs)
            if not self.tools and (delta.text or logprobs):
                yield wire.part(self.shape, self.model.name, delta.text, logprobs)
            finish_reason = delta.finish_reason or finish_reason
        if self.tools:
            content, calls, finish_reason = self.finish(text, finish_reason)
            yield wire.part(self.shape, self.model.name, content, tool_calls=calls)
        yield wire.done(self.shape, self.model.name, "", finish_reason, self.durations(), context=self.context())

    def run(self):
        """The deltas of the one choice; a client that leaves closes this generator, and so the session."""
        for index, delta in self.choices.run(self.make_request, lambda: False, self.stats):
            self.generated_ids += [item.token_id for item in delta.logprobs]
            yield index, delta

    def finish(self, text: str, finish_reason: str):
        """(content, tool calls, finish_reason) of a whole reply: tool calls when the reply parses as them."""
        calls = parse_tool_calls(text, self.tools) if self.tools else None
        if calls:
            return "", [wire.tool_call(index, name, arguments) for index, (name, arguments) in enumerate(calls)], \
                "tool_calls"
        return text, None, finish_reason

    def logprobs(self, items) -> Optional[list[dict]]:
        return wire.logprobs(self.model.tokenizer, items, self.top) if self.top is not None else None

    def context(self) -> Optional[list[int]]:
        """/api/generate's `context`: the prompt's and the reply's token ids to continue from (no stop token)."""
        if self.prompt_ids is None:
            return None
        return self.prompt_ids + [token for token in self.generated_ids if token not in self.model.stop_ids]

    def durations(self) -> dict:
        return wire.durations(self.stats, self.load_seconds)


# ------------------------------------------------------------------------------------------ embeddings


@blueprint.post("/embed")
def embed():
    """Ollama's embeddings are L2-normalized (cut to `dimensions` first); inputs too long for the context are cut
    unless truncate is false."""
    fields = json_fields(OllamaEmbedRequest)
    engine = get_engine()
    stats = engine.stats.begin()
    model, load_seconds = load_model(engine, fields.model)
    token_lists = [embedding_ids(model, text, f"input[{index}]", fields.truncate is not False)
                   for index, text in enumerate(fields.input)]
    vectors = []
    for ids in token_lists:
        vector = engine.embed(model.name, ids, None)
        if fields.dimensions and fields.dimensions > len(vector):
            raise BadRequest(f"dimensions: at most {len(vector)} for {model.name}", field="dimensions")
        vectors.append(normalized(vector[: fields.dimensions]))
    prompt_tokens = sum(len(ids) for ids in token_lists)
    return jsonify(wire.embeddings(model.name, vectors, stats, load_seconds, prompt_tokens))


@blueprint.post("/embeddings")
def embeddings():
    """The older route: one prompt, its vector as the model gives it (not normalized); an empty prompt, none."""
    fields = json_fields(OllamaEmbeddingsRequest)
    engine = get_engine()
    model, _ = load_model(engine, fields.model)
    if not fields.prompt:
        return jsonify(embedding=[])
    return jsonify(embedding=engine.embed(model.name, embedding_ids(model, fields.prompt, "prompt", False), None))


def embedding_ids(model: ServedModel, text: str, field: str, truncate: bool) -> list[int]:
    ids = model.encode(text, at_start=True)
    if not ids:
        raise BadRequest(f"{field}: must not be empty", field=field)
    if truncate:
        return ids[: model.config.max_session_length]
    check_context_length(model.config, len(ids), 0, field)
    return ids


def normalized(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(value * value for value in vector))
    return [value / norm for value in vector] if norm else vector


# ------------------------------------------------------------------------------------------ models


@blueprint.get("/tags")
def tags():
    """The served models, as /v1/models lists them (configured ones, and discovered ones the swarm covers)."""
    engine = get_engine()
    loaded = {model.name: model for model in engine.loaded_models()}
    entries = []
    for listed in engine.listed_models():
        model = loaded.get(listed["name"])
        config = model.config if model else engine.model_config(listed["name"])
        entries.append(wire.model_entry(config, model.remote.config if model else None))
    return jsonify(models=entries)


@blueprint.get("/ps")
def running():
    """The models whose client half (embeddings, LM head, tokenizer) this gateway has loaded."""
    return jsonify(models=[wire.running_entry(model.config, model.remote.config)
                           for model in get_engine().loaded_models()])


@blueprint.post("/show")
def show():
    fields = json_fields(OllamaShowRequest)
    model, _ = load_model(get_engine(), fields.model or fields.name)
    capabilities = ["completion", "tools"] if model.tokenizer.chat_template else ["completion"]
    return jsonify(wire.show(model, capabilities))


@blueprint.get("/version")
def version():
    """Open without a key, as /health is: clients ask it first to tell an Ollama server, and it tells nothing else."""
    return jsonify(version=wire.OLLAMA_VERSION)
