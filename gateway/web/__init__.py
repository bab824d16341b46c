"""The Flask side of the gateway, shared by every dialect: what happens to a request around its route.

In the order a request meets them:

    request_ids.py     a request id per request: taken from or put in X-Request-ID, and on every log line
    access.py          API keys, CORS and the WebSocket Origin check; who a caller is (its key, else its address)
    limits.py          body size, requests per minute per client, open WebSockets (413, 429)
    bodies.py          a body read into its schema: JSON checked, a bad field a 400 that names it
    current_engine.py  the app's one Engine, read by every route with get_engine()
    held_sessions.py   the sessions a request opened for itself, closed however it ends
    sse.py, ndjson.py  streamed replies: server-sent events, newline-delimited JSON; an error as the last event
    metrics.py         requests per API and status, open sessions and WebSockets, and GET /metrics
    health.py          GET /health and GET /api/v1/swarm (not counted among the APIs' requests)
"""
