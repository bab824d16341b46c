"""Ollama's API under /api (chat, generate, embed, embeddings, tags, show, ps, version): thin translators to the engine.

A request is read into its schema (schemas.py), translated once into chat's terms (translate.py), planned on the chat
path (chat/plan.py), and its reply (chat/reply.py) written in Ollama's wire format (format.py): NDJSON lines unless
`stream` is false. Errors are {"error": "..."} with Ollama's status codes, for the requests `speaks` says are Ollama's.
"""

from __future__ import annotations

import math
import time
from typing import Optional

from flask import Blueprint, jsonify, request

from gateway.chat.params import offered_tools, requested_top_logprobs
from gateway.chat.plan import chat_prompt_ids
from gateway.chat.reasoning import template_kwargs, template_thinks
from gateway.engine.encoders import Encoder
from gateway.engine.generation import Engine
from gateway.engine.lengths import check_context_length
from gateway.engine.served import ServedModel
from gateway.errors import BadRequest, NotFound
from gateway.ollama import format as wire
from gateway.ollama.schemas import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)
from gateway.ollama.translate import (chat_messages, generate_prompt_ids, plan_reply, refuse_unsupported,
                                      requested_think, templated)
from gateway.web.bodies import load_json, parse
from gateway.web.current_engine import get_engine
from gateway.web.limits import check_input_count, check_input_tokens, work_slot
from gateway.web.ndjson import ndjson_stream

blueprint = Blueprint("ollama", __name__, url_prefix="/api")
OTHER_APIS = ("/api/v1", "/api/v2", "/api/oai")  # Petals' HTTP and WebSocket APIs, Ai00's OpenAI prefix
LATEST = ":latest"  # Ollama's default tag: "tiny:latest" is "tiny"


error_body = wire.error_body


def register(app) -> None:
    app.register_blueprint(blueprint)  # under /api, beside Petals' /api/v1 and /api/v2


def speaks() -> bool:
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


def respond(reply: wire.OllamaReply, stream: Optional[bool]):
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
    refuse_unsupported(fields, model)
    if not fields.messages:
        return respond_loaded("chat", model, fields)
    # a forced call (tool_choice, this gateway's extension) is one call; a free choice may make several
    tool_choice = offered_tools(fields.tool_choice, fields.tools, parallel=False)
    prompt_ids = chat_prompt_ids(model, chat_messages(fields.messages), tool_choice.tools,
                                 template_kwargs=template_kwargs(requested_think(fields)))
    top = requested_top_logprobs(fields)
    plan = plan_reply(engine, model, fields, prompt_ids, "messages", top, tool_choice)
    return respond(wire.OllamaReply("chat", plan, stats, load_seconds, top=top), fields.stream)


@blueprint.post("/generate")
def generate():
    fields = json_fields(OllamaGenerateRequest)
    engine = get_engine()
    stats = engine.stats.begin()
    model, load_seconds = load_model(engine, fields.model)
    refuse_unsupported(fields, model)
    if not fields.prompt and not fields.system:
        return respond_loaded("generate", model, fields)
    prompt_ids = generate_prompt_ids(model, fields)
    top = requested_top_logprobs(fields)
    # the generated tokens' ids come with their logprobs: asked for (0 alternatives) even when not shown, for `context`
    plan = plan_reply(engine, model, fields, prompt_ids, "prompt", 0 if top is None else top,
                      templated=templated(model, fields))
    reply = wire.OllamaReply("generate", plan, stats, load_seconds, top=top, context=prompt_ids)
    return respond(reply, fields.stream)


# ------------------------------------------------------------------------------------------ embeddings


@blueprint.post("/embed")
def embed():
    """Ollama's embeddings are L2-normalized (cut to `dimensions` first); inputs too long for the context are cut
    unless truncate is false."""
    fields = json_fields(OllamaEmbedRequest)
    engine = get_engine()
    stats = engine.stats.begin()
    encoder = embedding_model(engine, fields.model)
    if encoder is not None:
        return jsonify(encoder_embed(engine, encoder, fields, stats))
    model, load_seconds = load_model(engine, fields.model)
    check_input_count(engine.limits, "input", len(fields.input))
    token_lists = [embedding_ids(model, text, f"input[{index}]", fields.truncate is not False)
                   for index, text in enumerate(fields.input)]
    prompt_tokens = sum(len(ids) for ids in token_lists)
    check_input_tokens(engine.limits, "input", prompt_tokens)
    vectors = []
    with work_slot(engine):
        for ids in token_lists:
            vector = engine.embed(model.name, ids, None)
            if fields.dimensions and fields.dimensions > len(vector):
                raise BadRequest(f"dimensions: at most {len(vector)} for {model.name}", field="dimensions")
            vectors.append(normalized(vector[: fields.dimensions]))
    return jsonify(wire.embeddings(model.name, vectors, stats, load_seconds, prompt_tokens))


@blueprint.post("/embeddings")
def embeddings():
    """The older route: one prompt, its vector as the model gives it (not normalized); an empty prompt, none."""
    fields = json_fields(OllamaEmbeddingsRequest)
    engine = get_engine()
    encoder = embedding_model(engine, fields.model)
    if encoder is not None:
        return jsonify(embedding=encoder_embedding(engine, encoder, fields.prompt))
    model, _ = load_model(engine, fields.model)
    if not fields.prompt:
        return jsonify(embedding=[])
    ids = embedding_ids(model, fields.prompt, "prompt", False)
    check_input_tokens(engine.limits, "prompt", len(ids))
    with work_slot(engine):
        return jsonify(embedding=engine.embed(model.name, ids, None))


def embedding_model(engine: Engine, name: Optional[str]) -> Optional[Encoder]:
    """The embedding model (EMBEDDING_MODELS) that `name` names, with or without Ollama's :latest; None: not one."""
    if name and name.endswith(LATEST):
        return engine.encoders.get(name) or engine.encoders.get(name[: -len(LATEST)])
    return engine.encoders.get(name)


def encoder_embed(engine: Engine, encoder: Encoder, fields: OllamaEmbedRequest, stats) -> dict:
    """All the inputs in one encode call, each vector normalized as Ollama's are; an input longer than the encoder
    reads is cut as sentence-transformers cuts it (truncate: false refuses it)."""
    check_input_count(engine.limits, "input", len(fields.input))
    load_seconds = encoder.load()
    if not fields.input:  # as for a chat model: no input, no vector
        return wire.embeddings(encoder.name, [], stats, load_seconds, 0)
    for index, text in enumerate(fields.input):
        if not text:
            raise BadRequest(f"input[{index}]: must not be empty", field=f"input[{index}]")
    counts = encoder.token_counts(fields.input)
    if fields.truncate is False:
        encoder.check_fits(counts, "input")
    prompt_tokens = sum(min(count, encoder.max_tokens) for count in counts)
    check_input_tokens(engine.limits, "input", prompt_tokens)
    with work_slot(engine):
        vectors = encoder.encode(fields.input, fields.dimensions, normalize=True)
    return wire.embeddings(encoder.name, vectors, stats, load_seconds, prompt_tokens)


def encoder_embedding(engine: Engine, encoder: Encoder, prompt: str) -> list[float]:
    """The older route: the vector as the model gives it (normalized only if its modules normalize)."""
    if not prompt:
        return []
    counts = encoder.token_counts([prompt])
    encoder.check_fits(counts, "prompt", listed=False)
    check_input_tokens(engine.limits, "prompt", counts[0])
    with work_slot(engine):
        return encoder.encode([prompt])[0]


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
        entry = wire.model_entry(config, model.remote.config if model else None)
        entry["details"]["parent_model"] = listed.get("parent", "")  # a LoRA adapter's base model
        entries.append(entry)
    entries += [wire.embedding_model_entry(encoder.name, str(encoder.folder), encoder.family)
                for encoder in engine.encoders]
    return jsonify(models=entries)


@blueprint.get("/ps")
def running():
    """The models whose client half (embeddings, LM head, tokenizer) this gateway has loaded."""
    return jsonify(models=[wire.running_entry(model.config, model.remote.config)
                           for model in get_engine().loaded_models()])


@blueprint.post("/show")
def show():
    fields = json_fields(OllamaShowRequest)
    encoder = embedding_model(get_engine(), fields.model or fields.name)
    if encoder is not None:
        return jsonify(wire.embedding_model_show(encoder.name, encoder.family, encoder.dimension, encoder.max_tokens))
    model, _ = load_model(get_engine(), fields.model or fields.name)
    template = model.tokenizer.chat_template
    capabilities = ["completion", "tools"] if template else ["completion"]
    capabilities += ["thinking"] if template_thinks(template) else []
    return jsonify(wire.show(model, capabilities))


@blueprint.get("/version")
def version():
    """Open without a key, as /health is: clients ask it first to tell an Ollama server, and it tells nothing else."""
    return jsonify(version=wire.OLLAMA_VERSION)
