"""OpenAI's Responses API, under the OpenAI prefixes: /responses (create, stream, background), and a stored one's
get, delete and cancel.

    routes.py      the routes, and ResponseRun: one response generated, its events, its stored record kept current
    translate.py   a Responses request -> the chat request it runs as (instructions, history, input items, tools)
    format.py      the response object, its output items and the numbered stream events
    store.py       stored responses (store: true): a cap, idle expiry, what previous_response_id continues
    schemas.py     the request shapes
"""
