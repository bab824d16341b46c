"""The OpenAPI document of every HTTP API (/openapi.json), built from the request schemas themselves, and a
Swagger UI page at /docs (and Ai00's /api-docs/) whose assets come from the swagger-ui-bundle package."""

from __future__ import annotations

from functools import lru_cache

from flask import Blueprint, Response, jsonify, send_from_directory
from pydantic.json_schema import models_json_schema

from gateway import schemas

blueprint = Blueprint("docs", __name__)

# (path, method, request schema or None, summary)
ROUTES = [
    ("/v1/chat/completions", "post", schemas.ChatCompletionRequest, "Chat completion (stream with SSE)"),
    ("/v1/completions", "post", schemas.CompletionRequest, "Text completion (stream with SSE)"),
    ("/v1/embeddings", "post", schemas.EmbeddingRequest, "Embeddings: mean-pooled hidden states of the model"),
    ("/v1/chooses", "post", schemas.ChooseRequest, "Ai00: rank choices by perplexity, best first"),
    ("/v1/models", "get", None, "Served models"),
    ("/tokenize", "post", schemas.TokenizeRequest, "Text or messages to token ids"),
    ("/detokenize", "post", schemas.DetokenizeRequest, "Token ids to text"),
    ("/stats", "get", None, "Prefill and decode speed of the last request"),
    ("/verbose_stats", "get", None, "Speeds over recent requests"),
    ("/api/v1/generate", "post", schemas.HttpGenerate, "Petals Chat: generate, optionally in a session"),
    ("/api/v1/open_inference_session", "post", schemas.OpenSession, "Petals Chat: open an inference session"),
    ("/api/v1/close_inference_session", "post", schemas.CloseSession, "Petals Chat: close an inference session"),
    ("/api/v1/models", "get", None, "Served models and their block coverage"),
    ("/health", "get", None, "200 when the default model can be served now, else 503"),
]

ERROR = {"description": "an error, with a message that names the field", "content": {"application/json": {}}}


@lru_cache(maxsize=1)
def openapi_document() -> dict:
    bodies = [(schema, "validation") for _, _, schema, _ in ROUTES if schema is not None]
    refs, definitions = models_json_schema(bodies, ref_template="#/components/schemas/{model}")
    paths: dict = {}
    for path, method, schema, summary in ROUTES:
        operation = {"summary": summary, "responses": {"200": {"description": "OK"}, "400": ERROR, "404": ERROR,
                                                       "503": ERROR}}
        if schema is not None:
            body_schema = refs[(schema, "validation")]
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body_schema}}}
        paths.setdefault(path, {})[method] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "Swarm inference gateway", "version": "0.1.0",
                 "description": "Petals Chat's HTTP API and an OpenAI-compatible API over a swarm of block servers. "
                                "WebSocket: /api/v2/generate. The OpenAI routes also live under /api/oai and "
                                "/api/oai/v1."},
        "paths": paths,
        "components": {"schemas": definitions.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


@blueprint.get("/openapi.json")
def openapi_json():
    return jsonify(openapi_document())


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
