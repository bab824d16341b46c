"""A request's JSON body read into a schema, for the OpenAI-style APIs (chat and text completions, Responses, ...).

What is not a JSON object is a 400; a bad field is a 400 naming it; unknown fields are accepted and ignored, as
vLLM does, and each unknown name is logged once.
"""

from __future__ import annotations

import logging

from flask import request

from gateway.errors import BadRequest
from gateway.schemas import load_json, parse

logger = logging.getLogger(__name__)
_unknown_fields_logged: set[str] = set()
UNKNOWN_FIELDS_REMEMBERED = 1000  # the names are the clients' to choose: a bound on memory and on the log


def json_body(schema):
    """The request's body validated into `schema` (a pydantic model class)."""
    if not request.is_json:
        raise BadRequest("the body must be a JSON object (Content-Type: application/json)")
    fields = parse(schema, load_json(request.get_data()))
    for name in (fields.model_extra or {}):
        if name not in _unknown_fields_logged and len(_unknown_fields_logged) < UNKNOWN_FIELDS_REMEMBERED:
            _unknown_fields_logged.add(name)
            logger.info("ignoring unknown request field %.80r", name)
    return fields
