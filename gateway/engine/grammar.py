"""Structured output: constrained decoding with llguidance (JSON object / JSON schema / Lark / GBNF / regex).

    spec = GrammarSpec("json_schema", {"type": "object", ...})
    grammars = TokenizerGrammars(hf_tokenizer, vocab_size)   # once per served model (~0.3 s for SmolLM2)
    grammars.check(spec)                                     # GrammarError (a 400) before any generation
    constraint = grammars.constraint(spec)                   # one per sequence
    while not constraint.is_finished():
        logits.masked_fill_(~constraint.allowed(), -inf)     # (vocab_size,) bool; EOS allowed when the grammar may end
        token = sample(logits)
        constraint.accept(token)                             # GrammarError if the token was not allowed
        if token is EOS: break

llguidance does the parsing (an Earley parser over a lexer, walking the tokenizer's trie); this module only
compiles specs into llguidance grammars, caches compiled matchers, and turns llguidance's bitmask into a bool
mask over the LM head's vocabulary.

JSON output may use whitespace as JSON allows, but at most 32 whitespace characters in a row (enough for
pretty-printing, indent=4 at depth 7): unbounded whitespace lets a small model (or a random walk) wander in blank
lines forever. A schema may override this with its own top-level "x-guidance" options. (llguidance 1.9.1's
compact mode, whitespace_flexible=False, was avoided: its token mask refuses some tokens that its parser accepts,
e.g. '"}' closing a nested object inside an array, which would steer a model off its natural tokenization.)

`strict` (json_schema's `strict`): when True, unsupported keywords or formats are an error, and an object schema
with `properties` but no `additionalProperties` gets `additionalProperties: false` (the OpenAI strict-mode
reading: the output has the schema's properties and no others; not where allOf is used, or where `required`
names a property that `properties` does not list). When False, unsupported keywords and formats
are ignored and omitted `additionalProperties` means what JSON Schema says (any further properties allowed).

Measured cost, SmolLM2-135M-Instruct tokenizer (49152 tokens), 2-core CPU sandbox, llguidance 1.9.1:
Constraint.allowed() (llguidance.numpy's bitmask fill into a preallocated int32 buffer, then numpy.unpackbits
into a bool tensor: ~4 us of it) takes a median of 7-12 us per token (p90 ~20 us) on JSON schemas, tool calls
and GBNF, with rare steps up to ~0.5-2 ms where llguidance builds lexer states lazily; accept() ~1 us.
Building TokenizerGrammars ~0.3 s; compiling a spec 0.6-2 ms, after which constraint() for the same spec is a
cached deep copy (~15 us).
Apply the mask with logits.masked_fill_(~mask, -inf) (~20-30 us here); boolean indexing / nonzero over the 49k
entries is slower (~45 us median here, with multi-millisecond outliers seen under load).
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np
import torch

import llguidance
import llguidance.hf
import llguidance.numpy  # not llguidance.torch: importing it costs ~1.5 s (it pulls in torch._dynamo)
from llguidance import LLMatcher, LLParserLimits
from llguidance.gbnf_to_lark import any_to_lark

from gateway.engine.lengths import nesting_depth
from gateway.errors import BadRequest

KINDS = ("json_object", "json_schema", "lark", "gbnf", "regex")

# JSON whitespace, at most 32 characters at each place it may appear (llguidance's x-guidance options).
JSON_FORMAT = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,32}"}

_CACHE_SIZE = 64  # compiled template matchers kept per tokenizer
# a schema's JSON nesting: far above any real one (OpenAI allows 10 levels of objects), far below a RecursionError
MAX_SCHEMA_DEPTH = 64


class GrammarError(BadRequest, ValueError):
    """A grammar or schema that cannot be compiled, or a token the grammar does not allow: the client's to fix,
    so a 400 wherever it surfaces (also mid-generation, as a stream's last event)."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    value: object = None  # schema dict (or JSON text) for json_schema; grammar text for lark/gbnf; pattern for regex
    strict: bool = True  # json_schema's `strict`, see the module docstring


# ---------------------------------------------------------------------------------------------------------------
# Spec -> llguidance grammar text


def _schema_dict(value: Any) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise GrammarError(f"json_schema is not valid JSON: {error}") from None
    if isinstance(value, bool):
        value = {} if value else {"not": {}}
    if not isinstance(value, dict):
        raise GrammarError(f"json_schema must be a JSON object, not {type(value).__name__}")
    if nesting_depth(value) > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"json_schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
    return value


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
# ("not" and "if" are left alone: closing a negated or conditional schema would widen what it lets through.)
_SCHEMA_VALUES = ("additionalProperties", "items", "then", "else", "contains", "unevaluatedProperties",
                  "unevaluatedItems", "additionalItems")
_OPEN_MARKERS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
                 "$ref")


def _uses_all_of(schema: Any) -> bool:
    if isinstance(schema, dict):
        return "allOf" in schema or any(_uses_all_of(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_uses_all_of(v) for v in schema)
    return False


def _close_objects(schema: Any) -> Any:
    """A copy of `schema` where every plain object schema with `properties` (and whose `required` names only
    those properties) forbids other properties."""
    if isinstance(schema, list):
        return [_close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: _close_objects(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            closed[key] = [_close_objects(sub) for sub in value]
        elif key in _SCHEMA_VALUES:
            closed[key] = _close_objects(value)
        else:
            closed[key] = value
    properties = schema.get("properties")
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    if isinstance(properties, dict) and not any(marker in schema for marker in _OPEN_MARKERS) \
            and all(name in properties for name in required):
        closed["additionalProperties"] = False
    return closed


def _closed(schema: Any) -> Any:
    """`schema` with closed objects, unless it uses allOf: allOf intersects object schemas, and closing each
    branch would forbid the other branches' properties."""
    return schema if _uses_all_of(schema) else _close_objects(schema)


def _json_grammar(schema: dict, strict: bool) -> str:
    if strict:
        schema = _closed(schema)
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults={**JSON_FORMAT, "lenient": not strict})
    except (ValueError, TypeError) as error:
        raise GrammarError(f"invalid json_schema: {error}") from None


def _text(spec: GrammarSpec) -> str:
    if not isinstance(spec.value, str) or not spec.value.strip():
        raise GrammarError(f"a {spec.kind} grammar must be a non-empty string")
    return spec.value


def compile_spec(spec: GrammarSpec) -> str:
    """The llguidance grammar (a JSON string) for `spec`; GrammarError for what can be seen without a tokenizer."""
    if not isinstance(spec, GrammarSpec):
        raise GrammarError(f"expected a GrammarSpec, got {type(spec).__name__}")
    if spec.kind == "json_object":
        return _json_grammar({"type": "object"}, strict=True)
    if spec.kind == "json_schema":
        return _json_grammar(_schema_dict(spec.value), bool(spec.strict))
    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(_text(spec))
    if spec.kind == "gbnf":
        try:
            lark = any_to_lark(_text(spec))
        except GrammarError:
            raise
        except Exception as error:  # GbnfToLarkError and friends
            raise GrammarError(f"invalid gbnf grammar: {error}") from None
        return LLMatcher.grammar_from_lark(lark)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(_text(spec))
    raise GrammarError(f"unknown grammar kind {spec.kind!r}; expected one of {', '.join(KINDS)}")


def _cache_key(spec: GrammarSpec) -> str:
    try:
        value = json.dumps(spec.value, ensure_ascii=False)
    except (TypeError, ValueError):
        value = repr(spec.value)
    return f"{spec.kind}\0{bool(spec.strict)}\0{value}"


def _clean(message: str) -> str:
    return message.replace("<non-verbose/>", "").strip() or "unknown error"


# ---------------------------------------------------------------------------------------------------------------
# Per-model grammars and per-sequence constraints


class TokenizerGrammars:
    """Built once per served model (cost: building llguidance's tokenizer from the HF tokenizer, ~0.3 s).
    Thread-safe: compiled specs are cached (LRU) and shared; each constraint() is a private copy."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Optional[Iterable[int]] = None):
        """`vocab_size` is the LM head's size (may exceed len(tokenizer)); `eos_token_ids` are the ids that end a
        sequence (default: the tokenizer's eos_token_id); all of them are allowed exactly when the grammar may end."""
        eos = sorted(set(eos_token_ids)) if eos_token_ids is not None else [hf_tokenizer.eos_token_id]
        if not eos or any(e is None for e in eos):
            raise ValueError("the tokenizer has no eos_token_id; pass eos_token_ids")
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(e) for e in eos)
        n_vocab = max(self.vocab_size, len(hf_tokenizer), max(self.eos_token_ids) + 1)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab,
                                                         eos_token=list(self.eos_token_ids))
        self.limits = LLParserLimits(verbose_errors=False)  # errors become user-facing messages
        self._decode = hf_tokenizer.convert_ids_to_tokens
        self._templates: "OrderedDict[str, LLMatcher]" = OrderedDict()
        self._lock = threading.Lock()

    def _template(self, spec: GrammarSpec) -> LLMatcher:
        key = _cache_key(spec)
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return template
        grammar = compile_spec(spec)
        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self.limits)  # drops the GIL
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind}: {_clean(matcher.get_error())}")
        with self._lock:
            self._templates[key] = matcher
            while len(self._templates) > _CACHE_SIZE:
                self._templates.popitem(last=False)
        return matcher

    def check(self, spec: GrammarSpec) -> None:
        """Raise GrammarError for an invalid grammar or schema, without starting generation."""
        self._template(spec)

    def constraint(self, spec: GrammarSpec) -> "Constraint":
        """A fresh matcher for one sequence."""
        template = self._template(spec)
        with self._lock:  # the template is shared; copy it under the lock
            matcher = template.deep_copy()
        return Constraint(self, matcher)


class Constraint:
    """One sequence's position in its grammar. Not thread-safe: one sequence, one thread at a time."""

    def __init__(self, grammars: TokenizerGrammars, matcher: LLMatcher):
        self._grammars = grammars
        self._matcher = matcher
        self._vocab_size = grammars.vocab_size
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, grammars.ll_tokenizer.vocab_size)  # int32 words
        self._bytes = self._bitmask.view(np.uint8).reshape(-1)  # the same memory, as bytes
        self.tokens: list[int] = []

    def allowed(self) -> torch.Tensor:
        """Bool mask (vocab_size,) of the tokens allowed next; EOS is allowed exactly when the grammar may end."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask)
        if self._matcher.is_error():
            raise GrammarError(f"grammar matching failed: {_clean(self._matcher.get_error())}")
        bits = np.unpackbits(self._bytes, count=self._vocab_size, bitorder="little")  # bit i of the mask = token i
        return torch.from_numpy(bits).view(torch.bool)

    def accept(self, token_id: int) -> None:
        """Advance past `token_id`; GrammarError if the grammar does not allow it here."""
        token_id = int(token_id)
        if self._matcher.is_error():
            raise GrammarError(f"grammar matching already failed: {_clean(self._matcher.get_error())}")
        if not 0 <= token_id < self._vocab_size or not self._matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} ({self._token_name(token_id)}) is not allowed by the grammar here")
        self.tokens.append(token_id)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar would take in a row from here (a draft's checkable part); no change."""
        fits = not self._matcher.is_error() and all(0 <= token < self._vocab_size for token in tokens)
        return self._matcher.validate_tokens(tokens) if fits else 0

    def is_finished(self) -> bool:
        """True once the grammar is complete and nothing more may follow (only EOS is allowed; stop generating)."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (EOS would be allowed)."""
        return self._matcher.is_accepting()

    def _token_name(self, token_id: int) -> str:
        try:
            return repr(self._grammars._decode(token_id))
        except Exception:
            return "out of vocabulary"


# ---------------------------------------------------------------------------------------------------------------
# Forced tool calls


def _rebase_refs(schema: Any, base: str) -> Any:
    """A copy of `schema` with its local `$ref`s ("#...") rewritten to point under `base` ("#/$defs/x")."""
    if isinstance(schema, list):
        return [_rebase_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            rebased[key] = base + value[1:]
        else:
            rebased[key] = _rebase_refs(value, base)
    return rebased


def _named_choice(tool_choice: Any) -> Optional[str]:
    if tool_choice == "required":
        return None
    if isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else tool_choice.get("name")
        if isinstance(name, str) and name:
            return name
    shape = '{"type": "function", "function": {"name": ...}}'
    raise GrammarError(f'tool_choice must be "required" or {shape} to force a tool call, '
                       f"not {json.dumps(tool_choice, default=str)[:200]}")


def tool_call_spec(tools: list[dict], tool_choice: Any, parallel: bool) -> GrammarSpec:
    """A json_schema spec forcing `{"name": <tool>, "arguments": {...valid against its parameters...}}`, or with
    `parallel` a JSON array of one or more of them. `tools` are OpenAI tool dicts; `tool_choice` is "required"
    (any of the tools) or {"type": "function", "function": {"name": ...}} (exactly that one).
    Arguments never carry properties that the parameters schema does not list (objects are closed, as in strict
    mode: a model must not invent arguments). Unsupported keywords and formats are errors only when every
    function offered says `"strict": true`; otherwise they are ignored, as OpenAI's non-strict mode does."""
    functions = _chosen_functions(_tool_functions(tools), tool_choice)
    defs, calls = _call_schemas(functions)
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": call, "minItems": 1} if parallel else dict(call)
    schema["$defs"] = defs
    strict = all(function.get("strict") is True for function in functions.values())
    return GrammarSpec("json_schema", schema, strict=strict)


def _tool_functions(tools: list[dict]) -> dict[str, dict]:
    """The tools' function dicts by name, each checked: a name, unique, and parameters that are an object."""
    if not isinstance(tools, list) or not tools:
        raise GrammarError("tools must be a non-empty list to force a tool call")
    functions: dict[str, dict] = {}
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise GrammarError(f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise GrammarError(f"tools[{index}].function.name must be a non-empty string")
        if name in functions:
            raise GrammarError(f"tools[{index}]: duplicate function name {name!r}")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise GrammarError(f"tools[{index}].function.parameters must be a JSON schema object")
        if nesting_depth(parameters) > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"tools[{index}].function.parameters is nested deeper than {MAX_SCHEMA_DEPTH} levels")
        functions[name] = function
    return functions


def _chosen_functions(functions: dict[str, dict], tool_choice: Any) -> dict[str, dict]:
    """All the functions for "required"; only the named one for a named choice."""
    wanted = _named_choice(tool_choice)
    if wanted is None:
        return functions
    if wanted not in functions:
        raise GrammarError(f"tool_choice names function {wanted!r}, which is not among the tools "
                           f"({', '.join(map(repr, functions))})")
    return {wanted: functions[wanted]}


def _call_schemas(functions: dict[str, dict]) -> tuple[dict[str, Any], list[dict]]:
    """One call object schema per function, its closed parameters schema under $defs (tool_0, tool_1, ...)."""
    defs: dict[str, Any] = {}
    calls = []
    for index, (name, function) in enumerate(functions.items()):
        parameters = function.get("parameters")
        if parameters is None:  # a function without parameters takes an empty object
            parameters = {"type": "object", "properties": {}, "additionalProperties": False}
        key = f"tool_{index}"
        parameters = {k: v for k, v in copy.deepcopy(parameters).items() if k not in ("$schema", "$id")}
        defs[key] = _closed(_rebase_refs(parameters, f"#/$defs/{key}"))
        calls.append({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/{key}"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    return defs, calls
