"""The OpenAI-compatible API (a superset of MLC-LLM's, mistral.rs's and Ai00's): thin translators to the engine.

`register` puts the routes under PREFIXES (OpenAI's /v1, and Ai00's /api/oai and /api/oai/v1), with the Responses
API (responses/) beside them; `extras` holds the routes that live at the root (/tokenize, /detokenize, /stats,
/verbose_stats), and stateful.py MLC-Chat's stateful /chat/completions and /chat/reset. Errors take OpenAI's envelope (format.error_body) for the requests that `speaks` says are OpenAI's.
"""

from __future__ import annotations

import base64
import math
import struct

from flask import Blueprint, jsonify, request

from gateway.chat.params import requested_top_logprobs
from gateway.chat.plan import plan_generation
from gateway.chat.prompts import render_chat
from gateway.engine.lengths import check_context_length
from gateway.errors import BadRequest
from gateway.openai import format as wire
from gateway.openai import state_routes, stateful
from gateway.openai.responses.routes import blueprint as responses_blueprint
from gateway.openai.schemas import (
    ChatCompletionRequest,
    ChooseRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    EmbedsRequest,
    TokenizeRequest,
)
from gateway.openai.translate import plan_chat, prompt_token_lists, saved_state
from gateway.web.bodies import json_body
from gateway.web.current_engine import get_engine
from gateway.web.limits import check_input_count, check_input_tokens, work_slot
from gateway.web.sse import event_stream

blueprint = Blueprint("openai", __name__)
extras = Blueprint("openai_extras", __name__)
PREFIXES = ("/v1", "/api/oai", "/api/oai/v1")
error_body = wire.error_body


def register(app) -> None:
    """Chat and text completions and the rest under each prefix; the Responses API where chat completions are."""
    for prefix in PREFIXES:
        app.register_blueprint(blueprint, url_prefix=prefix, name="openai" + prefix.replace("/", "_"))
    app.register_blueprint(extras)
    app.register_blueprint(stateful.blueprint)  # MLC-Chat's /chat/completions and /chat/reset, at the root
    for prefix in PREFIXES:
        app.register_blueprint(responses_blueprint, url_prefix=prefix,
                               name="openai_responses" + prefix.replace("/", "_"))
        app.register_blueprint(state_routes.blueprint, url_prefix=prefix,
                               name="openai_states" + prefix.replace("/", "_"))


def speaks() -> bool:
    """Whether this request's errors take OpenAI's envelope: its routes, and unknown paths under its prefixes."""
    if request.blueprint is not None:
        return request.blueprint.startswith("openai")
    return request.path.startswith(tuple(prefix + "/" for prefix in PREFIXES))


# ------------------------------------------------------------------------------------------ generation


@blueprint.post("/chat/completions")
def chat_completions():
    fields = json_body(ChatCompletionRequest)
    engine = get_engine()
    top = requested_top_logprobs(fields)
    plan = plan_chat(engine, fields, logprobs=top)
    include_usage = bool(fields.stream_options and fields.stream_options.include_usage)
    replies = wire.ChatCompletionReplies(plan, top, include_usage, engine.stats.begin())
    if not fields.stream:
        return jsonify(replies.completion())
    return event_stream(replies.chunks, wire.error_body)


@blueprint.post("/completions")
def completions():
    fields = json_body(CompletionRequest)
    engine = get_engine()
    model = engine.model(fields.model)
    prompts = prompt_token_lists(model, fields.prompt)
    if fields.state is not None:  # each prompt goes on from the state's tokens, which its servers already hold
        state = saved_state(engine, model, fields.state, chat=False)
        prompts = [state.tokens + ids for ids in prompts]
        fields = fields.model_copy(update={"cache_salt": state.key.salt})
    if len(prompts) > engine.max_sessions_per_client:  # each prompt holds a session of its own while it runs
        raise BadRequest(f"prompt: at most {engine.max_sessions_per_client} prompts in one request "
                         "(MAX_SESSIONS_PER_CLIENT)", field="prompt")
    plans = [plan_generation(engine, model, fields, ids, "prompt", logprobs=fields.logprobs) for ids in prompts]
    include_usage = bool(fields.stream_options and fields.stream_options.include_usage)
    replies = wire.TextCompletionReplies(engine, plans, fields.logprobs, fields.echo, include_usage,
                                         engine.stats.begin())
    if not fields.stream:
        return jsonify(replies.completion())
    return event_stream(replies.chunks, wire.error_body)


# ------------------------------------------------------------------------------------------ the rest


@blueprint.get("/models")
def models():
    """The chat models (owned by the swarm), then the embedding models, run in the gateway and marked as LM Studio
    marks them (type: embeddings)."""
    engine = get_engine()
    data = [{"id": model["name"], "object": "model", "created": 0, "owned_by": "swarm",
             "max_model_len": model["max_session_length"],
             **({"parent": model["parent"]} if "parent" in model else {})}  # a LoRA adapter's base, as vLLM lists it
            for model in engine.listed_models()]
    data += [{"id": encoder.name, "object": "model", "created": 0, "owned_by": "gateway", "type": "embeddings"}
             for encoder in engine.encoders]
    return jsonify(object="list", data=data)


@blueprint.post("/embeddings")
def embeddings():
    """An embedding model's name (EMBEDDING_MODELS) runs that encoder; any other, the chat model's hidden states."""
    fields = json_body(EmbeddingRequest)
    engine = get_engine()
    encoder = engine.encoders.get(fields.model)
    if encoder is not None:
        return jsonify(encoder_embeddings(engine, encoder, fields))
    model = engine.model(fields.model)
    if fields.input == "" or fields.input == []:
        raise BadRequest("input: must not be empty", field="input")
    check_input_count(engine.limits, "input", input_count(fields.input))
    token_lists = prompt_token_lists(model, fields.input)
    for ids in token_lists:
        if not ids:
            raise BadRequest("input: must not be empty", field="input")
        check_context_length(model.config, len(ids), 0, "input")
    tokens = sum(len(ids) for ids in token_lists)
    check_input_tokens(engine.limits, "input", tokens)
    data = []
    with work_slot(engine):
        for index, ids in enumerate(token_lists):
            vector = engine.embed(model.name, ids, fields.layer)
            if fields.dimensions:
                vector = vector[: fields.dimensions]
            data.append({"object": "embedding", "index": index, "embedding": encoded(vector, fields.encoding_format)})
    return jsonify(object="list", data=data, model=model.name,
                   usage={"prompt_tokens": tokens, "total_tokens": tokens})


def encoded(vector: list[float], encoding_format: str):
    """OpenAI's base64: the float32 values' little-endian bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def encoder_embeddings(engine, encoder, fields: EmbeddingRequest) -> dict:
    """All the inputs in one encode call. Text only: token ids would be another tokenizer's (clients count with
    tiktoken). An input longer than the encoder reads is refused, as OpenAI refuses one, rather than cut."""
    if fields.layer is not None:
        raise BadRequest(f"layer: {encoder.name} is an embedding model; layers are a chat model's", field="layer")
    texts = encoder_texts(fields.input, encoder.name)
    check_input_count(engine.limits, "input", len(texts))
    counts = encoder.token_counts(texts)
    encoder.check_fits(counts, "input", listed=not isinstance(fields.input, str))
    check_input_tokens(engine.limits, "input", sum(counts))
    with work_slot(engine):
        vectors = encoder.encode(texts, fields.dimensions)
    data = [{"object": "embedding", "index": index, "embedding": encoded(vector, fields.encoding_format)}
            for index, vector in enumerate(vectors)]
    return dict(object="list", data=data, model=encoder.name,
                usage={"prompt_tokens": sum(counts), "total_tokens": sum(counts)})


def encoder_texts(value, model_name: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if value == "" or not texts:  # as for a chat model
        raise BadRequest("input: must not be empty", field="input")
    if not all(isinstance(text, str) for text in texts):
        raise BadRequest(f"input: {model_name} takes text, not token ids (they would be another tokenizer's)",
                         field="input")
    for index, text in enumerate(texts):
        if not text:
            raise BadRequest(f"input[{index}]: must not be empty", field=f"input[{index}]")
    return texts


@blueprint.post("/embeds")
def embeds():
    """Ai00: each text cut into chunks of at most max_tokens tokens (fewer where the prefix and the encoder's own
    tokens leave less room), each chunk embedded after `prefix`: one vector per chunk."""
    fields = json_body(EmbedsRequest)
    engine = get_engine()
    encoder = engine.encoders.first(fields.model)
    texts = encoder_texts(fields.input, encoder.name)
    check_input_count(engine.limits, "input", len(texts))
    prefix_tokens = encoder.token_counts([fields.prefix])[0]  # the encoder's own tokens ([CLS], [SEP]) in
    if prefix_tokens >= encoder.max_tokens:
        raise BadRequest(f"prefix: {prefix_tokens} tokens with {encoder.name}'s own, which leaves no room for a chunk "
                         f"in the {encoder.max_tokens} it reads", field="prefix")
    chunked = [encoder.chunks(text, min(fields.max_tokens, encoder.max_tokens - prefix_tokens)) for text in texts]
    for index, chunks in enumerate(chunked):
        if not chunks:
            raise BadRequest(f"input[{index}]: has no tokens", field=f"input[{index}]")
    check_embeds_size(engine.limits, fields.prefix, sum(len(chunks) for chunks in chunked))
    pieces = [fields.prefix + chunk for chunks in chunked for chunk in chunks]
    check_input_tokens(engine.limits, "input", sum(encoder.token_counts(pieces)))
    with work_slot(engine):
        vectors = iter(encoder.encode(pieces))
    data = [{"object": "embed", "index": index, "chunks": [{"chunk": chunk, "embed": [next(vectors)]}
                                                           for chunk in chunks]}
            for index, chunks in enumerate(chunked)]
    return jsonify(object="embeds", model=encoder.name, data=data)


def check_embeds_size(limits, prefix: str, chunks: int) -> None:
    """/embeds puts the prefix before every chunk: the chunks are counted, and the copies of the prefix capped, before
    one is made (a long prefix before thousands of one-token chunks would be gigabytes). Capped in characters, since
    a long word is one [UNK] token: the pieces then come to at most twice the body, whatever the tokens."""
    check_input_count(limits, "input", chunks)  # each chunk is an input of the encoder's
    if len(prefix) * chunks > limits.max_body_bytes:
        raise BadRequest(f"prefix: {len(prefix)} characters before each of {chunks} chunks come to more than the "
                         f"{limits.max_body_bytes} of a request's body (MAX_BODY_BYTES); shorten the prefix or ask "
                         "for longer chunks (max_tokens)", field="prefix")


def input_count(value) -> int:
    """How many inputs an embeddings request holds: a text or a list of ids is one; a list of texts or lists, each."""
    if isinstance(value, str) or all(isinstance(item, int) for item in value):
        return 1
    return len(value)


@blueprint.post("/chooses")
def chooses():
    """Ai00: rank choices as continuations of the input by perplexity, best (lowest) first."""
    fields = json_body(ChooseRequest)
    engine = get_engine()
    model = engine.model(fields.model)
    check_input_count(engine.limits, "choices", len(fields.choices))
    context = model.encode("".join([fields.input] if isinstance(fields.input, str) else fields.input), at_start=True)
    continuations = []
    for index, choice in enumerate(fields.choices):
        continuation = model.encode(choice, at_start=False)
        if not continuation:
            raise BadRequest(f"choices[{index}]: must not be empty", field=f"choices[{index}]")
        check_context_length(model.config, len(context) + len(continuation), 0, f"choices[{index}]")
        continuations.append(continuation)
    check_input_tokens(engine.limits, "choices", sum(len(context) + len(ids) for ids in continuations))
    with work_slot(engine):
        scored = [(perplexity(engine, model.name, context, continuation), index, choice)
                  for index, (choice, continuation) in enumerate(zip(fields.choices, continuations))]
    data = [{"object": "choice", "index": index, "rank": rank, "choice": choice, "perplexity": value}
            for rank, (value, index, choice) in enumerate(sorted(scored))]
    return jsonify(object="list", data=data, model=model.name)


def perplexity(engine, model_name: str, context: list[int], continuation: list[int]) -> float:
    """The continuation's perplexity after the context, from one cache-less pass over both."""
    logprobs = engine.token_logprobs(model_name, context + continuation)[len(context):]
    if not context:
        logprobs = logprobs[1:] or logprobs  # the very first token has no context to be scored against
    values = [item.logprob for item in logprobs if item is not None]
    return math.exp(-sum(values) / max(len(values), 1))


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
    model.check_token_ids(fields.tokens, "tokens")
    text = model.tokenizer.decode(fields.tokens)
    return jsonify(prompt=text, content=text)


@extras.get("/stats")
def stats():
    return jsonify(get_engine().stats.summary())


@extras.get("/verbose_stats")
def verbose_stats():
    return jsonify(get_engine().stats.verbose())
