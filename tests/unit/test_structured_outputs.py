"""Structured output beyond JSON schema and GBNF (gateway.chat.structured): a regular expression and a choice among
strings, under vLLM's spellings, compiled by the same llguidance grammars as the rest (on the tiny test tokenizer).

As in test_grammar.py, the "model" is a seeded random walk among the tokens the constraint allows: whatever it
produces must match.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from gateway.errors import BadRequest
from gateway.engine.grammar import GrammarError, GrammarSpec, TokenizerGrammars, tool_call_spec
from gateway.chat.params import ToolChoice, compiled_constraint, constraint_spec, requested_constraint
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.web.bodies import parse
from gateway.chat.structured import REGEX_SPECIALS, choice_spec, escape_regex, requested_spec

TINY_VOCAB = 512


@pytest.fixture(scope="module")
def tiny():
    from tiny_model import build_tokenizer

    tokenizer = build_tokenizer(TINY_VOCAB)
    return tokenizer, TokenizerGrammars(tokenizer, TINY_VOCAB)


def random_walk(model, spec: GrammarSpec, seed: int, max_tokens: int = 200) -> str:
    """Uniformly among the allowed tokens until the grammar ends (or EOS is picked): the text produced."""
    tokenizer, grammars = model
    constraint = grammars.constraint(spec)
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    while len(tokens) < max_tokens and not constraint.is_finished():
        choices = np.flatnonzero(constraint.allowed().numpy())
        token = int(choices[torch.randint(len(choices), (1,), generator=generator)])
        constraint.accept(token)
        if token in grammars.eos_token_ids:
            break
        tokens.append(token)
    assert constraint.is_accepting(), "the walk ended where the grammar cannot"
    return tokenizer.decode(tokens)


def chat(**fields):
    return parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **fields})


# ------------------------------------------------------------------------------------------ spec builders

TRICKY = ["a.b", "(x)", "1+1=2?", "[tag]{2}", "^$|", "#&-~", "back\\slash", "new\nline", "Привет 🙂", 'say "hi"']


@pytest.mark.parametrize("text", TRICKY)
def test_escaped_text_is_matched_literally_and_only_it(tiny, text):
    pattern = escape_regex(text)
    assert re.fullmatch(pattern, text)  # Python reads the escapes alike
    assert random_walk(tiny, GrammarSpec("regex", pattern), seed=0) == text  # the only match: no freedom left


def test_every_special_character_is_escaped():
    specials = "".join(sorted(REGEX_SPECIALS))
    assert escape_regex(specials) == "".join("\\" + char for char in specials)
    assert escape_regex("plain words 123") == "plain words 123"


@pytest.mark.parametrize("seed", range(12))
def test_a_choice_is_one_of_the_choices(tiny, seed):
    choices = ["Paris", "Tokyo", "New York", "a.b", "(x)", "Paris, France"]
    assert random_walk(tiny, choice_spec(choices), seed) in choices


def test_every_choice_can_come_out(tiny):
    choices = ["yes", "no", "maybe"]
    assert {random_walk(tiny, choice_spec(choices), seed) for seed in range(40)} == set(choices)


def test_an_empty_choice_is_allowed_among_others(tiny):
    _, grammars = tiny
    eos = grammars.eos_token_ids[0]
    assert grammars.constraint(choice_spec(["", "x"])).allowed()[eos]  # the empty reply is one of them
    assert not grammars.constraint(choice_spec(["y", "x"])).allowed()[eos]


@pytest.mark.parametrize("seed", range(8))
def test_regex_output_matches(tiny, seed):
    pattern = r"(yes|no), [0-9]{2}-[a-z]{1,3}"
    assert re.fullmatch(pattern, random_walk(tiny, GrammarSpec("regex", pattern), seed))


# ------------------------------------------------------------------------------------------ the fields


@pytest.mark.parametrize("spelling, field", [({"structured_outputs": {"regex": "a+"}}, "structured_outputs.regex"),
                                             ({"guided_regex": "a+"}, "guided_regex")])
def test_regex_fields(spelling, field):
    assert requested_spec(chat(**spelling)) == (GrammarSpec("regex", "a+"), field)


@pytest.mark.parametrize("spelling, field", [
    ({"structured_outputs": {"choice": ["a", "b.c"]}}, "structured_outputs.choice"),
    ({"guided_choice": ["a", "b.c"]}, "guided_choice"),
])
def test_choice_fields(spelling, field):
    assert requested_spec(chat(**spelling)) == (GrammarSpec("regex", r"(?:a|b\.c)"), field)


def test_json_and_grammar_fields():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    for fields, kind, value, field in [
        ({"structured_outputs": {"json": schema}}, "json_schema", schema, "structured_outputs.json"),
        ({"guided_json": '{"type": "string"}'}, "json_schema", '{"type": "string"}', "guided_json"),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "gbnf", 'root ::= "a"', "structured_outputs.grammar"),
        ({"guided_grammar": 'start: "a"'}, "gbnf", 'start: "a"', "guided_grammar"),
        ({"structured_outputs": {"json_object": True}}, "json_object", None, "structured_outputs.json_object"),
        ({"grammar": 'root ::= "a"'}, "gbnf", 'root ::= "a"', "grammar"),
        ({"response_format": {"type": "json_object"}}, "json_object", None, "response_format"),
    ]:
        spec, named = requested_spec(chat(**fields))
        assert (spec.kind, spec.value, named) == (kind, value, field)
    assert requested_spec(chat(guided_json=schema))[0].strict is False  # JSON Schema's reading: objects stay open
    assert requested_spec(chat(response_format={"type": "text"})) is None and requested_spec(chat()) is None


def test_completions_take_the_same_fields():
    fields = parse(CompletionRequest, {"prompt": "x", "guided_choice": ["a"]})
    assert constraint_spec(fields) == GrammarSpec("regex", "(?:a)")


@pytest.mark.parametrize("fields, named", [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs.regex"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"grammar": 'root ::= "a"', "bnf_schema": 'root ::= "b"'}, "bnf_schema"),
])
def test_two_kinds_at_once_are_refused_naming_the_second(fields, named):
    with pytest.raises(BadRequest) as caught:
        requested_spec(chat(**fields))
    assert caught.value.field == named and caught.value.status == 400


def test_a_forced_tool_call_takes_precedence():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    fields = chat(tools=tools, tool_choice="required", guided_regex="a")
    spec, field = requested_constraint(fields, ToolChoice("required", fields.tools, False))
    assert field == "tools" and spec.kind == "json_schema"


@pytest.mark.parametrize("body, field", [({"guided_choice": []}, "guided_choice"),
                                         ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
                                         ({"guided_regex": 5}, "guided_regex")])
def test_malformed_fields_are_400s_naming_them(body, field):
    with pytest.raises(BadRequest) as caught:
        chat(**body)
    assert caught.value.field == field


@pytest.mark.parametrize("pattern", ["(", "[a-", "a{2,1}", r"\p{Nope}", "(?<=a)b", ""])
def test_bad_regexes_are_grammar_errors(tiny, pattern):
    _, grammars = tiny
    with pytest.raises(GrammarError):
        grammars.check(GrammarSpec("regex", pattern))


# ------------------------------------------------------------------------------------------ nesting


def nested_schema(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


class GrammarsOf:
    def __init__(self, tiny):
        self._grammars = tiny[1]

    def grammars(self):
        return self._grammars


def test_a_schema_nested_too_deep_is_a_400_naming_its_field_not_a_recursion_error(tiny):
    """A schema's depth is measured before anything walks it recursively (grammar.MAX_SCHEMA_DEPTH, 64 levels of
    JSON): a strict schema 400 objects deep raised a RecursionError (a 500) in the rewriting that closes objects."""
    model = GrammarsOf(tiny)
    for levels in (40, 400):
        schema = {"name": "deep", "strict": True, "schema": nested_schema(levels)}
        strict = {"type": "json_schema", "json_schema": schema}
        for fields, field in ((chat(response_format=strict), "response_format"),
                              (chat(guided_json=json.dumps(nested_schema(levels))), "guided_json")):
            with pytest.raises(BadRequest) as refused:
                compiled_constraint(model, requested_constraint(fields))
            assert refused.value.field == field and "nested deeper than 64 levels" in refused.value.message
    compiled_constraint(model, requested_constraint(chat(guided_json=nested_schema(30))))  # 61 levels of JSON: fine


def test_tool_parameters_nested_too_deep_are_refused(tiny):
    deep = {"type": "function", "function": {"name": "f", "parameters": nested_schema(400)}}
    with pytest.raises(GrammarError, match=r"tools\[0\]\.function\.parameters is nested deeper than 64 levels"):
        tool_call_spec([deep], "required", parallel=False)
