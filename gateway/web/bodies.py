"""Request bodies read into their schemas: JSON text checked, then validated by pydantic; a bad field is a 400 naming it.

    load_json(raw)          JSON text as Python values (what is not JSON, not finite, or nested deeper than
                            MAX_JSON_DEPTH, is a 400)
    parse(schema, data)     values validated into a pydantic model class
    json_body(schema)       the OpenAI-style APIs' body (chat and text completions, Responses, Anthropic): it must be
                            a JSON object; unknown fields are accepted and ignored, as vLLM does, each name logged once
"""

from __future__ import annotations

import json
import logging
import math

from flask import request
from pydantic import ValidationError

from gateway.engine.lengths import nesting_depth
from gateway.errors import BadRequest

logger = logging.getLogger(__name__)
_unknown_fields_logged: set[str] = set()
UNKNOWN_FIELDS_REMEMBERED = 1000  # the names are the clients' to choose: a bound on memory and on the log
# Far deeper than any real request (a JSON schema of OpenAI's 10 levels of objects is some 25), and far from where
# the code that walks a body recursively (schema rewriting, templates' tojson, echoes) meets Python's recursion limit
MAX_JSON_DEPTH = 100


def load_json(raw, what: str = "the body"):
    """JSON text (str or bytes) as Python values. Whatever is not JSON is a 400: bad syntax or encoding, nesting
    too deep for the parser, NaN or Infinity (JavaScript's, not JSON's), and numbers too large for a float; and so is
    JSON nested deeper than MAX_JSON_DEPTH, named by its top-level field."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise BadRequest(f"{what} is not valid JSON: nested too deeply") from None
    except (TypeError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRequest(f"{what} is not valid JSON: {error}") from None
    if nesting_depth(value) > MAX_JSON_DEPTH:
        deep = [name for name, item in value.items() if nesting_depth(item) >= MAX_JSON_DEPTH] \
            if isinstance(value, dict) else []
        where = f"{deep[0]}:" if deep else f"{what} is"
        raise BadRequest(f"{where} nested deeper than {MAX_JSON_DEPTH} levels", field=deep[0] if deep else None)
    return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large for a number")
    return value


def parse(schema, data):
    """Validate `data` into `schema` (a pydantic model class); a BadRequest names the first bad field."""
    if not isinstance(data, dict):
        raise BadRequest("the request must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        raise first_bad_field(error) from None


def first_bad_field(error: ValidationError, skip: int = 0) -> BadRequest:
    """The first error, as a 400 that names its field (`skip`: leading parts of its location that are no field)."""
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"][skip:])
    return BadRequest(f"{field}: {first['msg']}", field=field)


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
