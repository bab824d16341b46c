"""The OpenAPI document of every HTTP API (/openapi.json), built from the request schemas themselves with this
gateway's limits written in (MAX_NEW_TOKENS, the models' context) and every error reply's shape, and a Swagger UI
page at /docs (and Ai00's /api-docs/) whose assets come from the swagger-ui-bundle package. The fuzz test
(tests/e2e/test_fuzz.py) drives the APIs from this document."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Optional

from flask import Blueprint, Response, jsonify, send_from_directory
from pydantic.json_schema import models_json_schema

from config import Limits
from gateway.anthropic.schemas import AnthropicCountTokensRequest, AnthropicMessagesRequest
from gateway.ollama import schemas as ollama_schemas
from gateway.openai import schemas as openai_schemas
from gateway.openai.responses.schemas import ResponseCreateRequest
from gateway.petals import schemas as petals_schemas
from gateway.web.access import is_open
from gateway.web.current_engine import get_engine

blueprint = Blueprint("docs", __name__)

# (path, method, request schema or None, summary)
ROUTES = [
    ("/v1/chat/completions", "post", openai_schemas.ChatCompletionRequest, "Chat completion (stream with SSE)"),
    ("/v1/completions", "post", openai_schemas.CompletionRequest, "Text completion (stream with SSE)"),
    ("/v1/embeddings", "post", openai_schemas.EmbeddingRequest, "Embeddings: an embedding model's vectors "
     "(EMBEDDING_MODELS, run in the gateway), or a chat model's mean-pooled hidden states"),
    ("/v1/embeds", "post", openai_schemas.EmbedsRequest, "Ai00: an embedding model's vector of each chunk of a text"),
    ("/v1/chooses", "post", openai_schemas.ChooseRequest, "Ai00: rank choices by perplexity, best first"),
    ("/v1/responses", "post", ResponseCreateRequest, "Responses: a reply (stream: typed SSE events), tools, store"),
    ("/v1/responses/{response_id}", "get", None, "Responses: a stored response, as it stands"),
    ("/v1/responses/{response_id}", "delete", None, "Responses: delete a stored response"),
    ("/v1/responses/{response_id}/cancel", "post", None, "Responses: stop a response that is still generating"),
    ("/v1/messages", "post", AnthropicMessagesRequest, "Anthropic Messages: a reply (stream: SSE events), tools"),
    ("/v1/messages/count_tokens", "post", AnthropicCountTokensRequest, "Anthropic: the input tokens of a request"),
    ("/v1/models", "get", None, "Served models"),
    ("/v1/states", "post", openai_schemas.SaveStateRequest, "Save a prefix by name: requests starting with it fork it"),
    ("/v1/states", "get", None, "This client's saved states"),
    ("/v1/states/{name}", "delete", None, "Forget a saved state"),
    ("/tokenize", "post", openai_schemas.TokenizeRequest, "Text or messages to token ids"),
    ("/detokenize", "post", openai_schemas.DetokenizeRequest, "Token ids to text"),
    ("/stats", "get", None, "Prefill and decode speed of the last request"),
    ("/verbose_stats", "get", None, "Speeds over recent requests"),
    ("/chat/completions", "post", openai_schemas.ChatCompletionRequest,
     "MLC-Chat: stateful chat, the new messages continue the client's conversation kept on the server"),
    ("/chat/reset", "post", None, "MLC-Chat: start the client's conversation over"),
    ("/api/v1/generate", "post", petals_schemas.HttpGenerate, "Petals Chat: generate, optionally in a session"),
    ("/api/v1/open_inference_session", "post", petals_schemas.OpenSession, "Petals Chat: open an inference session"),
    ("/api/v1/close_inference_session", "post", petals_schemas.CloseSession, "Petals Chat: close an inference session"),
    ("/api/v1/models", "get", None, "Served models and their block coverage"),
    ("/health", "get", None, "200 when the default model can be served now, else 503"),
    ("/api/chat", "post", ollama_schemas.OllamaChatRequest, "Ollama: chat, tools (NDJSON lines unless stream: false)"),
    ("/api/generate", "post", ollama_schemas.OllamaGenerateRequest, "Ollama: generate from a prompt (NDJSON lines)"),
    ("/api/embed", "post", ollama_schemas.OllamaEmbedRequest, "Ollama: normalized embeddings of one or more inputs "
     "(an embedding model's, or a chat model's hidden states)"),
    ("/api/embeddings", "post", ollama_schemas.OllamaEmbeddingsRequest, "Ollama (older): the embedding of a prompt"),
    ("/api/show", "post", ollama_schemas.OllamaShowRequest, "Ollama: a model's details, parameters and template"),
    ("/api/tags", "get", None, "Ollama: served models"),
    ("/api/ps", "get", None, "Ollama: the models this gateway has loaded"),
    ("/api/version", "get", None, "Ollama: the Ollama API version this gateway speaks (open without a key)"),
]

# Every error reply, in the envelope of its dialect (each dialect's format.py); the fuzz test checks replies against them.
ERROR_SCHEMAS = {
    "PetalsError": {"type": "object", "required": ["ok", "error", "code", "traceback"], "properties": {
        "ok": {"const": False}, "error": {"type": "string"}, "code": {"type": "string"},
        "field": {"type": "string"}, "traceback": {"type": "string", "description": "the same clean message"}}},
    "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "request_id": {"type": "string"}, "error": {
            "type": "object", "required": ["type", "message"], "properties": {
                "type": {"type": "string"}, "message": {"type": "string"}}}}},
    "OllamaError": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
    "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]}}}}},
}
ERROR_STATUSES = {
    "400": "invalid: the message names the field; context_length_exceeded when the prompt does not fit",
    "401": "an API key is required (when the gateway has keys)",
    "403": "saved states and MLC's stateful chat, on a gateway without API keys or KEYLESS_SHARING",
    "404": "unknown model or session",
    "409": "the session is busy with another request",
    "413": "the body is over MAX_BODY_BYTES",
    "429": "too many sessions, or requests, for now (see Retry-After)",
    "503": "the swarm cannot serve the model now",
}


def _responses(path: str) -> dict:
    shape = "PetalsError" if path.startswith(("/api/v1/", "/health")) else "OpenAIError"
    shape = "AnthropicError" if path.startswith("/v1/messages") else shape
    shape = "OllamaError" if path.startswith("/api/") and not path.startswith("/api/v1/") else shape
    error = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}}}
    return {"200": {"description": "OK"}, **{status: {"description": text, **error}
                                              for status, text in ERROR_STATUSES.items()}}


def _apply_limits(schemas: dict, limits: Limits, max_session_length: Optional[int]) -> None:
    """Write this gateway's bounds into the request schemas, so that the document says what a valid request is."""
    caps = {name: limits.max_new_tokens for name in ("max_new_tokens", "max_tokens", "max_completion_tokens",
                                                     "max_gen_len", "num_predict", "max_output_tokens")}
    if max_session_length is not None:  # None: no model's context is known yet (none configured or connected)
        caps["max_length"] = max_session_length
    for schema in schemas.values():
        for name, field in schema.get("properties", {}).items():
            for branch in field.get("anyOf", [field]):  # Optional[int] is an anyOf with null
                if name in caps and branch.get("type") == "integer":
                    branch["maximum"] = caps[name]


def _document_later_checks(schemas: dict) -> None:
    """What the routes check after the schema, where a union's errors would be less clear than theirs: prompts
    and inputs (texts or token ids) are not empty and ids are not negative; logit_bias is keyed by token id;
    a Petals generate has inputs, or a session to continue."""
    schemas["HttpGenerate"]["anyOf"] = [{"required": ["inputs"]}, {"required": ["session_id"]}]
    for schema in schemas.values():
        for name, field in schema.get("properties", {}).items():
            if name in ("prompt", "input", "tokens"):
                for branch in field.get("anyOf", [field]):
                    _non_empty(branch)
            if name in ("logit_bias", "bias"):
                for branch in field.get("anyOf", [field]):
                    if branch.get("type") == "object":
                        branch["propertyNames"] = {"pattern": "^[0-9]+$"}


def _non_empty(schema: dict) -> None:
    if schema.get("type") == "string":
        schema["minLength"] = 1
    elif schema.get("type") == "integer":
        schema["minimum"] = 0
    elif schema.get("type") == "array":
        schema["minItems"] = 1
        _non_empty(schema["items"])


@lru_cache(maxsize=4)
def openapi_document(limits: Limits = Limits(), max_session_length: Optional[int] = None) -> dict:
    """The document for a gateway with these limits and longest model context."""
    bodies = [(schema, "validation") for _, _, schema, _ in ROUTES if schema is not None]
    refs, definitions = models_json_schema(bodies, ref_template="#/components/schemas/{model}")
    _apply_limits(definitions.get("$defs", {}), limits, max_session_length)
    _document_later_checks(definitions.get("$defs", {}))
    paths: dict = {}
    for path, method, schema, summary in ROUTES:
        operation = {"summary": summary, "responses": _responses(path)}
        if "{" in path:  # /v1/responses/{response_id}: each name in braces is a path parameter
            operation["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                                       for name in re.findall(r"{(\w+)}", path)]
        if is_open(path):
            operation["security"] = []  # open even when the gateway has keys
        if schema is not None:
            body_schema = refs[(schema, "validation")]
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body_schema}}}
        paths.setdefault(path, {})[method] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "Swarm inference gateway", "version": "0.1.0",
                 "description": "Petals Chat's HTTP API and an OpenAI-compatible API over a swarm of block servers. "
                                "WebSocket: /api/v2/generate (open_inference_session with a session_id resumes "
                                "a stored session). The OpenAI routes also live under /api/oai and "
                                "/api/oai/v1. Ollama's API lives under /api (its streams are NDJSON)."},
        "paths": paths,
        "security": [{}, {"bearer": []}],  # a key only when the gateway is configured with keys
        "components": {"schemas": {**definitions.get("$defs", {}), **ERROR_SCHEMAS},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


@blueprint.get("/openapi.json")
def openapi_json():
    engine = get_engine()
    contexts = [model.max_session_length for model in engine.loaded_models()] + \
               [model.max_session_length for model in engine.settings.gateway.models if model.max_session_length]
    return jsonify(openapi_document(engine.settings.gateway.limits, max(contexts, default=None)))


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Swarm gateway API</title>
<link rel="stylesheet" href="/docs/assets/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="/docs/assets/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui"});</script>
</body></html>"""


@blueprint.get("/docs")
@blueprint.get("/docs/")
@blueprint.get("/api-docs/")
def docs_page():
    return Response(PAGE, mimetype="text/html")


@blueprint.get("/docs/assets/<path:filename>")
def docs_asset(filename: str):
    from swagger_ui_bundle import swagger_ui_path

    return send_from_directory(swagger_ui_path, filename)
