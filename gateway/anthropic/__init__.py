"""Anthropic's Messages API under /v1: /v1/messages (tools, streamed events) and /v1/messages/count_tokens.

    routes.py      the routes; `register`, and `speaks` (which requests get Anthropic's error envelope)
    translate.py   a request in chat's terms: messages, tool_use and tool_result blocks, tools, tool choice, sampling
    format.py      Anthropic's wire shapes: a message, its stream events, the error envelope; the reply in them
    schemas.py     the request shapes (text, tool_use and tool_result blocks)
"""
