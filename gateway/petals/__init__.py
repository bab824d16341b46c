"""Petals Chat's APIs: HTTP under /api/v1 and the WebSocket session protocol at /api/v2/generate.

    routes.py      /api/v1/generate, open_inference_session, close_inference_session, /api/v1/models; `register`
    websocket.py   /api/v2/generate: a session per connection, streamed replies, chat mode, a stop message
    translate.py   Petals-style generation fields -> the engine's GenerationRequest, the model's defaults filled in
    format.py      the error envelope {ok: false, error, code, traceback}: the gateway's default shape
    schemas.py     the request and message shapes (lenient: form and query strings too)
"""
