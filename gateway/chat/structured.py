"""Which structured output a request asks for, as a grammar spec and the field that asked for it.

OpenAI's response_format (json_object, json_schema), llama.cpp's `grammar` and Ai00's `bnf_schema` (GBNF or Lark),
and vLLM's spellings: `structured_outputs` {json, regex, choice, grammar, json_object} and the older guided_json,
guided_regex, guided_choice and guided_grammar. A request sets at most one of them (as vLLM requires): two would
each constrain the reply, and no reply need satisfy both.

A choice among strings becomes a regular expression that matches exactly one of them, each escaped, so that the
engine enforces every kind through the same llguidance constraint (engine/grammar.py).
"""

from __future__ import annotations

from typing import Optional

from gateway.errors import BadRequest
from gateway.engine.grammar import GrammarSpec

# what Rust's regex_syntax::escape escapes: llguidance parses regular expressions with that crate
REGEX_SPECIALS = frozenset("\\.+*?()|[]{}^$#&-~")


def escape_regex(text: str) -> str:
    """A regular expression (llguidance's dialect) that matches `text` literally."""
    return "".join("\\" + char if char in REGEX_SPECIALS else char for char in text)


def choice_spec(choices: list[str]) -> GrammarSpec:
    """A spec whose only matches are the given strings."""
    return GrammarSpec("regex", "(?:" + "|".join(escape_regex(choice) for choice in choices) + ")")


def requested_spec(fields) -> Optional[tuple[GrammarSpec, str]]:
    """(spec, field) of the one structured output that `fields` (schemas.SamplingFields) asks for, if any;
    a 400 naming the second field when two are set."""
    requested = _requested(fields)
    if len(requested) > 1:
        (first, _), (second, _) = requested[:2]
        raise BadRequest(f"{second}: only one kind of structured output per request, and {first} is set too",
                         field=second)
    return (requested[0][1], requested[0][0]) if requested else None


def _requested(fields) -> list[tuple[str, GrammarSpec]]:
    """(field, spec) for every structured-output field that `fields` sets."""
    found = []
    response_format = fields.response_format
    if response_format is not None and response_format.type == "json_object":
        found.append(("response_format", GrammarSpec("json_object")))
    if response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise BadRequest("response_format.json_schema: required for type json_schema",
                             field="response_format.json_schema")
        schema = response_format.json_schema
        found.append(("response_format", GrammarSpec("json_schema", schema.schema_, strict=bool(schema.strict))))
    for name in ("grammar", "bnf_schema"):
        if getattr(fields, name):
            found.append((name, GrammarSpec("gbnf", getattr(fields, name))))  # GBNF, or Lark as it is
    outputs = fields.structured_outputs
    if outputs is not None:
        found += _vllm_specs("structured_outputs.", outputs.json_, outputs.regex, outputs.choice, outputs.grammar)
        if outputs.json_object:
            found.append(("structured_outputs.json_object", GrammarSpec("json_object")))
    found += _vllm_specs("guided_", fields.guided_json, fields.guided_regex, fields.guided_choice,
                         fields.guided_grammar)
    return found


def _vllm_specs(prefix: str, json_schema, regex, choice, grammar) -> list[tuple[str, GrammarSpec]]:
    """vLLM's four kinds, under either spelling (prefix "structured_outputs." or "guided_")."""
    found = []
    if json_schema is not None:  # JSON Schema's own reading (objects stay open), as vLLM's guided_json has it
        found.append((prefix + "json", GrammarSpec("json_schema", json_schema, strict=False)))
    if regex is not None:
        found.append((prefix + "regex", GrammarSpec("regex", regex)))
    if choice is not None:
        found.append((prefix + "choice", choice_spec(choice)))
    if grammar is not None:
        found.append((prefix + "grammar", GrammarSpec("gbnf", grammar)))
    return found
