"""Constrained decoding (gateway.engine.grammar) on the tiny test tokenizer and on the real SmolLM2 tokenizer.

The "model" is a seeded random walk: at each step it picks uniformly among the allowed tokens, until the
constraint is finished or it picks EOS. Whatever it produces must parse and match the grammar.
"""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
import torch

from gateway.engine.grammar import Constraint, GrammarError, GrammarSpec, TokenizerGrammars, tool_call_spec

TINY_VOCAB = 512  # the tiny model's LM head is larger than its trained tokenizer (428 tokens)


@pytest.fixture(scope="module")
def tiny():
    from tiny_model import build_tokenizer

    tokenizer = build_tokenizer(TINY_VOCAB)
    return tokenizer, TokenizerGrammars(tokenizer, TINY_VOCAB)


@pytest.fixture(scope="module")
def real(real_model):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(real_model)
    vocab_size = transformers.AutoConfig.from_pretrained(real_model).vocab_size
    return tokenizer, TokenizerGrammars(tokenizer, vocab_size)


@pytest.fixture(params=["tiny", pytest.param("real", marks=pytest.mark.real_model)])
def model(request):
    """(hf tokenizer, TokenizerGrammars) for each of the two tokenizers."""
    return request.getfixturevalue(request.param)


def random_walk(model, spec: GrammarSpec, seed: int = 0, max_tokens: int = 400) -> tuple[str, bool]:
    """Sample uniformly among allowed tokens; (decoded text, whether the grammar ended) after at most max_tokens."""
    tokenizer, grammars = model
    constraint = grammars.constraint(spec)
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    while len(tokens) < max_tokens:
        if constraint.is_finished():
            break
        allowed = constraint.allowed()
        assert allowed.shape == (grammars.vocab_size,) and allowed.dtype == torch.bool
        assert not allowed[len(tokenizer):].any(), "ids past the tokenizer are never allowed"
        eos_allowed = allowed[list(grammars.eos_token_ids)]
        assert bool(eos_allowed.all()) == bool(eos_allowed.any()) == constraint.is_accepting()
        choices = np.flatnonzero(allowed.numpy())  # torch.nonzero measured ~3 ms a call in this loop
        assert len(choices) > 0
        token = int(choices[torch.randint(len(choices), (1,), generator=generator)])
        constraint.accept(token)
        if token in grammars.eos_token_ids:
            return tokenizer.decode(tokens), True
        tokens.append(token)
    finished = constraint.is_finished()
    if finished:  # nothing but EOS may follow
        assert constraint.allowed().nonzero().flatten().tolist() == sorted(grammars.eos_token_ids)
    return tokenizer.decode(tokens), finished


def feed(model, spec: GrammarSpec, text: str) -> Constraint:
    """A constraint that has accepted `text`'s tokens (GrammarError where the grammar refuses one). Where the
    grammar accepts a token, its mask must have allowed it: the model's natural tokenization stays open to it."""
    tokenizer, grammars = model
    constraint = grammars.constraint(spec)
    for token in tokenizer.encode(text, add_special_tokens=False):
        allowed = bool(constraint.allowed()[token])
        constraint.accept(token)
        assert allowed, f"the mask refused {tokenizer.decode([token])!r}, which the grammar accepts"
    return constraint


def conforms(value, schema: dict, root: dict | None = None) -> bool:
    """The JSON Schema subset these tests use (jsonschema is not a dependency of the project)."""
    root = root if root is not None else schema
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part]
        return conforms(value, target, root)
    if "anyOf" in schema and not any(conforms(value, option, root) for option in schema["anyOf"]):
        return False
    if "const" in schema and value != schema["const"]:
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    checks = {
        "object": lambda: isinstance(value, dict), "array": lambda: isinstance(value, list),
        "string": lambda: isinstance(value, str), "boolean": lambda: isinstance(value, bool),
        "integer": lambda: isinstance(value, int) and not isinstance(value, bool),
        "number": lambda: isinstance(value, (int, float)) and not isinstance(value, bool),
        "null": lambda: value is None, None: lambda: True,
    }
    if not checks[kind]():
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < schema.get("minimum", float("-inf")) or value > schema.get("maximum", float("inf")):
            return False
    if isinstance(value, str) and not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1e9):
        return False
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1e9):
            return False
        if "items" in schema and not all(conforms(item, schema["items"], root) for item in value):
            return False
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        if any(name not in value for name in schema.get("required", [])):
            return False
        for name, item in value.items():
            if name in properties:
                if not conforms(item, properties[name], root):
                    return False
            elif schema.get("additionalProperties", True) is False:
                return False
    return True


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "nickname": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
    },
    "required": ["name", "age", "member", "tags", "address"],
}


# ---------------------------------------------------------------------------------------------------------------
# Generated output matches the grammar


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_validates(model, seed):
    text, finished = random_walk(model, GrammarSpec("json_schema", PERSON), seed)
    assert finished, text
    value = json.loads(text)
    assert conforms(value, PERSON), text
    assert set(value) <= set(PERSON["properties"]), "strict: no properties beyond the schema's"
    assert re.fullmatch(r"[0-9]{5}", value["address"]["zip"])


def test_json_schema_as_json_text(model):
    text, finished = random_walk(model, GrammarSpec("json_schema", json.dumps(PERSON)), 7)
    assert finished and conforms(json.loads(text), PERSON)


PERSON_VALUE = {"name": "Ada", "age": 36, "score": 0.75, "member": True, "tags": ["red", "blue"],
                "address": {"city": "London", "zip": "12345"}, "nickname": None}
CALLS_VALUE = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
               {"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "now", "arguments": {}}]


@pytest.mark.parametrize("style", [{}, {"separators": (",", ":")}, {"indent": 2}, {"indent": 4}])
def test_common_json_layouts_are_accepted(model, style):
    """Compact, Python's default and pretty-printed JSON all pass, token by token, with the mask allowing each."""
    assert feed(model, GrammarSpec("json_schema", PERSON), json.dumps(PERSON_VALUE, **style)).is_finished()
    spec = tool_call_spec(TOOLS, "required", parallel=True)
    assert feed(model, spec, json.dumps(CALLS_VALUE, **style)).is_finished()
    assert feed(model, GrammarSpec("json_object"), json.dumps({"a": [1, {"b": None}], "c": "x y"}, **style))


def test_whitespace_runs_are_bounded(model):
    with pytest.raises(GrammarError):
        feed(model, GrammarSpec("json_object"), "{" + " " * 40 + "}")


def test_json_object_outputs_any_object(model):
    objects = []
    for seed in range(30):  # most walks stop at once with "{}", or wander in a free-text key past the budget
        text, finished = random_walk(model, GrammarSpec("json_object"), seed, max_tokens=1000)
        if finished:
            objects.append(json.loads(text))
    assert objects and all(isinstance(value, dict) for value in objects)
    assert any(value for value in objects), "some walk produced a non-empty object"
    text = '{"a": [1, {"b": null}, "x"], "c": {"d": true}, "e": -1.5e3}'
    assert feed(model, GrammarSpec("json_object"), text).is_finished()
    with pytest.raises(GrammarError):
        feed(model, GrammarSpec("json_object"), "[1]")


@pytest.mark.parametrize("seed", range(3))
def test_gbnf_output_matches(model, seed):
    text, finished = random_walk(model, GrammarSpec("gbnf", 'root ::= "yes" | "no"'), seed)
    assert finished and text in ("yes", "no")
    grammar = 'root ::= answer " " number\nanswer ::= "yes" | "no"\nnumber ::= [1-9] [0-9]{0,2}\n'
    text, finished = random_walk(model, GrammarSpec("gbnf", grammar), seed)
    assert finished and re.fullmatch(r"(yes|no) [1-9][0-9]{0,2}", text), text


@pytest.mark.parametrize("seed", range(3))
def test_lark_output_matches(model, seed):
    grammar = 'start: "(" INT ("," INT)* ")"\nINT: /[0-9]{1,3}/\n'
    text, finished = random_walk(model, GrammarSpec("lark", grammar), seed)
    assert finished and re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", text), text


@pytest.mark.parametrize("seed", range(3))
def test_regex_output_matches(model, seed):
    text, finished = random_walk(model, GrammarSpec("regex", r"[0-9]{3}-[a-z]{2,5}"), seed)
    assert finished and re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", text), text


def test_eos_is_allowed_exactly_when_the_grammar_may_end(model):
    tokenizer, grammars = model
    eos = grammars.eos_token_ids[0]
    assert not grammars.constraint(GrammarSpec("regex", "ab+")).allowed()[eos]
    assert grammars.constraint(GrammarSpec("regex", "(ab)*")).allowed()[eos]  # the empty string matches
    constraint = feed(model, GrammarSpec("regex", "ab+"), "abb")
    assert constraint.allowed()[eos] and not constraint.is_finished()  # may end, or go on with more b's
    constraint.accept(eos)
    assert constraint.is_finished()


def test_several_eos_ids(tiny):
    tokenizer, _ = tiny
    eos_ids = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    grammars = TokenizerGrammars(tokenizer, TINY_VOCAB, eos_token_ids=eos_ids)
    constraint = feed((tokenizer, grammars), GrammarSpec("gbnf", 'root ::= "yes" | "no"'), "yes")
    assert constraint.is_finished()
    assert constraint.allowed().nonzero().flatten().tolist() == sorted(eos_ids)


# ---------------------------------------------------------------------------------------------------------------
# Strictness

def test_strict_schema_forbids_other_properties_and_lenient_allows_them(model):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with pytest.raises(GrammarError, match="not allowed"):
        feed(model, GrammarSpec("json_schema", schema), '{"a": 1, "b": 2}')
    assert feed(model, GrammarSpec("json_schema", schema, strict=False), '{"a": 1, "b": 2}').is_finished()
    # an explicit additionalProperties is respected either way
    open_schema = {**schema, "additionalProperties": {"type": "string"}}
    assert feed(model, GrammarSpec("json_schema", open_schema), '{"a": 1, "b": "x"}').is_finished()


def test_strict_rejects_unsupported_formats_lenient_ignores_them(model):
    _, grammars = model
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}
    with pytest.raises(GrammarError, match="no-such-format"):
        grammars.check(GrammarSpec("json_schema", schema))
    grammars.check(GrammarSpec("json_schema", schema, strict=False))


def test_allof_schemas_are_not_closed(model):
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    assert feed(model, GrammarSpec("json_schema", schema), '{"a": 1, "b": 2}').is_finished()


# ---------------------------------------------------------------------------------------------------------------
# Tool calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two digits",
    "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/digit"}, "b": {"$ref": "#/$defs/digit"}},
                   "required": ["a", "b"], "$defs": {"digit": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time"}}  # no parameters
TOOLS = [WEATHER, ADD, NOW]
BY_NAME = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object"}) for tool in TOOLS}


def assert_call(call):
    assert isinstance(call, dict) and set(call) == {"name", "arguments"}, call
    parameters = BY_NAME[call["name"]]
    assert conforms(call["arguments"], parameters, parameters), call
    assert set(call["arguments"]) <= set(parameters.get("properties", {})), "no invented arguments"


@pytest.mark.parametrize("seed", range(3))
def test_tool_call_named_function(model, seed):
    spec = tool_call_spec(TOOLS, {"type": "function", "function": {"name": "add"}}, parallel=False)
    text, finished = random_walk(model, spec, seed)
    assert finished, text
    call = json.loads(text)
    assert call["name"] == "add"
    assert_call(call)


def test_tool_call_required_picks_one_of_the_tools(model):
    names = set()
    for seed in range(8):
        text, finished = random_walk(model, tool_call_spec([WEATHER, ADD], "required", parallel=False), seed)
        assert finished, text
        call = json.loads(text)
        assert_call(call)
        names.add(call["name"])
    assert names == {"get_weather", "add"}


@pytest.mark.parametrize("seed", range(3))
def test_tool_calls_in_parallel(model, seed):
    text, finished = random_walk(model, tool_call_spec(TOOLS, "required", parallel=True), seed)
    assert finished, text
    calls = json.loads(text)
    assert isinstance(calls, list) and len(calls) >= 1
    for call in calls:
        assert_call(call)


def test_tool_call_fixed_texts(model):
    spec = tool_call_spec(TOOLS, "required", parallel=True)
    text = '[{"name": "now", "arguments": {}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]'
    assert feed(model, spec, text).is_finished()
    for bad in ('[]', '[{"name": "sub", "arguments": {}}]', '[{"name": "add", "arguments": {"a": 12, "b": 2}}]',
                '[{"name": "now", "arguments": {"x": 1}}]'):
        with pytest.raises(GrammarError):
            feed(model, spec, bad)


def test_tool_call_spec_errors():
    with pytest.raises(GrammarError, match="not among the tools"):
        tool_call_spec(TOOLS, {"type": "function", "function": {"name": "missing"}}, parallel=False)
    with pytest.raises(GrammarError, match="non-empty list"):
        tool_call_spec([], "required", parallel=False)
    with pytest.raises(GrammarError, match="tool_choice"):
        tool_call_spec(TOOLS, "auto", parallel=False)
    with pytest.raises(GrammarError, match="duplicate"):
        tool_call_spec([ADD, ADD], "required", parallel=False)
    with pytest.raises(GrammarError, match=r"tools\[0\]"):
        tool_call_spec([{"type": "function"}], "required", parallel=False)
    spec = tool_call_spec([{**ADD, "function": {**ADD["function"], "strict": True}}], "required", parallel=False)
    assert spec.kind == "json_schema" and spec.strict
    assert not tool_call_spec(TOOLS, "required", parallel=False).strict


# ---------------------------------------------------------------------------------------------------------------
# Invalid specs and tokens


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("json_schema", {"type": "objectx"}), "objectx"),
    (GrammarSpec("json_schema", '{"type": "object",'), "not valid JSON"),
    (GrammarSpec("json_schema", ["not", "an", "object"]), "JSON object"),
    (GrammarSpec("json_schema", {"$ref": "#/$defs/missing"}), "missing"),
    (GrammarSpec("json_schema", {"type": "string", "pattern": "(?=a)"}), "look-around"),
    (GrammarSpec("json_schema", {"type": "object", "properties": {}, "required": ["a"],
                                 "additionalProperties": False}), "required property 'a'"),
    (GrammarSpec("lark", "start: foo"), "unknown name"),
    (GrammarSpec("gbnf", 'root ::= ("yes" '), "Expected ')'"),
    (GrammarSpec("gbnf", 'root ::= undefined-rule'), "undefined"),
    (GrammarSpec("regex", "(abc"), "unclosed group"),
    (GrammarSpec("regex", ""), "non-empty"),
    (GrammarSpec("lark", None), "non-empty string"),
    (GrammarSpec("yaml", "a: b"), "unknown grammar kind"),
])
def test_invalid_specs_raise_grammar_error(tiny, spec, message):
    _, grammars = tiny
    with pytest.raises(GrammarError, match=re.escape(message)) as raised:
        grammars.check(spec)
    assert isinstance(raised.value, ValueError)
    with pytest.raises(GrammarError):
        grammars.constraint(spec)


def test_disallowed_tokens_raise(model):
    tokenizer, grammars = model
    spec = GrammarSpec("gbnf", 'root ::= "yes" | "no"')
    constraint = grammars.constraint(spec)
    maybe = tokenizer.encode("maybe", add_special_tokens=False)[0]
    assert not constraint.allowed()[maybe]
    with pytest.raises(GrammarError, match="not allowed"):
        constraint.accept(maybe)
    with pytest.raises(GrammarError):  # a failed matcher stays failed
        constraint.accept(tokenizer.encode("yes", add_special_tokens=False)[0])
    for token in (grammars.eos_token_ids[0], grammars.vocab_size, -1, grammars.vocab_size - 1):
        with pytest.raises(GrammarError):  # EOS before the grammar may end, and ids out of range
            grammars.constraint(spec).accept(token)
    constraint = feed(model, spec, "no")
    with pytest.raises(GrammarError):  # nothing but EOS after the end
        constraint.accept(tokenizer.encode("no", add_special_tokens=False)[0])


def test_constraints_are_independent(tiny):
    spec = GrammarSpec("regex", "(ab|cd)")
    first = feed(tiny, spec, "ab")
    second = feed(tiny, spec, "cd")
    assert first.is_finished() and second.is_finished()
    assert first.tokens != second.tokens


@pytest.mark.real_model
def test_mask_is_cheap_on_the_real_tokenizer(real):
    """allowed() runs at every generated token; measured ~5-25 us per token (see gateway/engine/grammar.py)."""
    tokenizer, grammars = real
    constraint = grammars.constraint(GrammarSpec("json_schema", PERSON))
    text = '{"name": "Ada", "age": 36, "member": true, "tags": ["red"], "address": {"city": "London", "zip": "12345"}}'
    tokens = tokenizer.encode(text, add_special_tokens=False)
    constraint.allowed()  # warm up
    started = time.perf_counter()
    for token in tokens:
        assert constraint.allowed()[token]
        constraint.accept(token)
    per_token = (time.perf_counter() - started) / len(tokens)
    assert constraint.is_finished()
    assert per_token < 0.002, f"{per_token * 1e6:.0f} us per token"
