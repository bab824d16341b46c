"""Saved states over HTTP (gateway/engine/saved_states.py), under the OpenAI API's prefixes:

    POST   /v1/states          {name, messages | prompt, model?, cache_salt?} -> the state (its token count)
    GET    /v1/states          the client's saved states
    DELETE /v1/states/{name}   forget one (the servers free its pages once no fork shares them)

A chat or text completion names one with Ai00's `state` field (its messages or prompt then come first), or just
starts with the same prefix: either way its servers fork the state's caches instead of computing them again.
"""

from __future__ import annotations

from flask import Blueprint, jsonify

from gateway.chat.prompts import render_chat
from gateway.errors import BadRequest
from gateway.openai.schemas import SaveStateRequest
from gateway.web.access import caller_state_guard, client_id
from gateway.web.bodies import json_body
from gateway.web.current_engine import get_engine
from gateway.web.limits import check_input_tokens

blueprint = Blueprint("openai_states", __name__)  # "openai...": its errors take OpenAI's envelope
blueprint.before_request(caller_state_guard("saved states"))  # without keys: KEYLESS_SHARING


@blueprint.post("/states")
def save_state():
    fields = json_body(SaveStateRequest)
    if (fields.messages is None) == (fields.prompt is None):
        raise BadRequest("messages or prompt: give exactly one of them", field="messages")
    engine = get_engine()
    model = engine.model(fields.model)
    if fields.messages is not None:
        ids = model.encode(render_chat(model.tokenizer, fields.messages, None, as_prefix=True), at_start=False)
    elif isinstance(fields.prompt, str):
        ids = model.encode(fields.prompt, at_start=True)
    else:
        model.check_token_ids(fields.prompt, "prompt")
        ids = list(fields.prompt)
    check_input_tokens(engine.limits, "messages" if fields.messages else "prompt", len(ids))
    state = engine.save_state(model, fields.name, ids, client_id(), fields.cache_salt or "", fields.messages)
    return jsonify(state.as_dict())


@blueprint.get("/states")
def list_states():
    states = get_engine().states.of(client_id())
    return jsonify(object="list", data=[state.as_dict() for state in states])


@blueprint.delete("/states/<name>")
def delete_state(name: str):
    get_engine().states.delete(client_id(), name)
    return jsonify(object="state.deleted", name=name, deleted=True)
