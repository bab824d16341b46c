"""The OpenAI-compatible API under /v1, /api/oai and /api/oai/v1: a superset of MLC-LLM's, mistral.rs's and Ai00's.

    routes.py      chat and text completions, models, embeddings (and Ai00's embeds), chooses, tokenize/detokenize,
                   stats; `register`
    translate.py   a chat request planned (messages rendered, tools offered); a completion's prompts as token ids
    format.py      OpenAI's wire shapes, and the replies of a chat or text completion written in them
    schemas.py     the request shapes beyond chat's shared fields (chat/schemas.py)
    responses/     OpenAI's Responses API, translated onto the chat completions' path
"""
