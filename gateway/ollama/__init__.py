"""Ollama's API under /api: chat, generate (NDJSON streams), embed, embeddings, tags, show, ps, version.

    routes.py      the routes; `register`, and `speaks` (which requests get Ollama's error shape)
    translate.py   options, format and messages in chat's terms; a reply planned
    format.py      Ollama's wire shapes: reply lines, durations in nanoseconds, models, errors; the reply in them
    schemas.py     the request shapes (strict, as Ollama's Go structs are)
"""
