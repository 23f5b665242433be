"""Structured outputs: OpenAI's `response_format` compiled into the engine's token grammar (`engine.grammar`).

- `{"type": "text"}` or no field: free text.
- `{"type": "json_object"}` (JSON mode): the output is one JSON object.
- `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`: the output is JSON that
  the schema accepts.

vLLM's `structured_outputs` field takes one of `json` (a schema object), `json_object` (true), `regex` (the output
matches it whole), `choice` (the output is one of these strings) or `grammar` (a Lark grammar in llguidance's
dialect) instead; a request may set it or a non-text `response_format`, not both.

The grammar is compiled here, on the request's parsing thread, by the llguidance library over the served tokenizer
(`GrammarCompiler`), so a schema it cannot take is a 400 naming `response_format.json_schema.schema` before anything
is queued. JSON follows llguidance's defaults (whitespace between tokens allowed; a schema may override them under
`x-guidance`). A request with a grammar finishes with `stop` as soon as the JSON is complete. In a chat served with
a reasoning parser the grammar is reasoning-aware (`gate_for_reasoning`): the think block is free text, and the
grammar constrains what follows it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from typing import Any, Optional, Sequence

from engine.errors import RequestError
from engine.grammar import ThinkGate, TokenGrammar, mask_words
from engine.sampling_params import check_bool
from launch.reasoning import ThinkTags, prompt_opens_thinking

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
POOL_MIN_CPUS = 4  # llguidance's pool takes 80% of the CPUs: on 2 it has one thread (docs/benchmarks.md)
JSON_OBJECT_SCHEMA = {"type": "object"}


class GrammarCompiler:
    """One per served tokenizer: compiles grammars into `TokenGrammar`s over the model's `vocab_size` ids (ids past
    the tokenizer's are never allowed; `eos_ids` may end a complete output). The llguidance tokenizer is built on
    first use (once, under a lock: a 150k-id vocabulary takes a noticeable fraction of a second) and shared."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]):
        self._hf, self.vocab_size, self._eos = tokenizer, vocab_size, list(eos_ids)
        self._lock = threading.Lock()
        self._ll: Any = None
        self._executor: Any = None  # llguidance's thread pool for the masks of several rows (`engine.grammar`)

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                import llguidance
                import llguidance.hf

                self._ll = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                        eos_token=self._eos or None)
                if (os.cpu_count() or 1) >= POOL_MIN_CPUS:  # with fewer, its one thread only adds hand-offs
                    self._executor = llguidance.LLExecutor()
            return self._ll

    def compile(self, grammar: str, kind: str, param: str) -> TokenGrammar:
        """`grammar`: llguidance's grammar text (`LLMatcher.grammar_from_*`); a grammar it refuses raises
        `RequestError` naming `param`."""
        import llguidance

        ll = self._ll_tokenizer()
        err = llguidance.LLMatcher.validate_grammar(grammar, ll)
        if not err:
            matcher = llguidance.LLMatcher(ll, grammar)
            err = matcher.get_error() if matcher.is_error() else ""
        if err:
            raise RequestError(f"'{param}' cannot be compiled: {' '.join(err.split())[:240]}", param, "invalid_schema")
        return TokenGrammar(matcher, mask_words(self.vocab_size), kind, self._executor)

    def json_schema(self, schema: dict, kind: str, param: str) -> TokenGrammar:
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        except ValueError as exc:
            raise RequestError(f"'{param}' is not a usable JSON schema: {exc}", param, "invalid_schema") from None
        return self.compile(grammar, kind, param)


def gate_for_reasoning(grammar: Optional[TokenGrammar], tags: Optional[ThinkTags],
                       prompt: Sequence[int]) -> Optional[TokenGrammar]:
    """`grammar` for one chat prompt under a reasoning parser's `tags`: it applies after the think block, which the
    prompt may already have opened (`launch.reasoning.prompt_opens_thinking`); as it is without tags."""
    if grammar is None or tags is None:
        return grammar
    return dataclasses.replace(grammar, think=ThinkGate(tags.start, tags.end, prompt_opens_thinking(prompt, tags)))


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 256


def parse_response_format(body: dict, compiler: Optional[GrammarCompiler]) -> Optional[TokenGrammar]:
    """The request's grammar from its `response_format` or `structured_outputs` (None: free text). Every problem is
    a 400 naming the field."""
    fmt = body.get("response_format")
    if body.get("structured_outputs") is not None:
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise RequestError("set 'structured_outputs' or 'response_format', not both", "structured_outputs",
                               "invalid_value")
        return _structured_outputs(body["structured_outputs"], compiler)
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise RequestError("'response_format' must be an object such as {\"type\": \"json_object\"}",
                           "response_format", "invalid_type")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise RequestError("'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", got "
                           f"{kind!r}"[:200], "response_format.type", "unsupported")
    if compiler is None:
        raise RequestError("this model has no tokenizer: 'response_format' needs one", "response_format",
                           "no_tokenizer")
    if kind == "json_object":
        return compiler.json_schema(JSON_OBJECT_SCHEMA, kind, "response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError("'response_format.json_schema' must be an object with a 'schema'",
                           "response_format.json_schema", "invalid_type")
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise RequestError("'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'",
                           "response_format.json_schema.name", "invalid_value")
    if spec.get("strict") is not None:
        check_bool("response_format.json_schema.strict", spec["strict"])
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise RequestError("'response_format.json_schema.schema' must be a JSON schema object",
                           "response_format.json_schema.schema", "invalid_type")
    return compiler.json_schema(schema, kind, "response_format.json_schema.schema")


def _structured_outputs(spec: object, compiler: Optional[GrammarCompiler]) -> TokenGrammar:
    """vLLM's `structured_outputs`: exactly one of `STRUCTURED_KINDS`."""
    if not isinstance(spec, dict):
        raise RequestError("'structured_outputs' must be an object such as {\"regex\": \"[0-9]+\"}",
                           "structured_outputs", "invalid_type")
    given = [k for k in STRUCTURED_KINDS if spec.get(k) is not None]
    if len(given) != 1:
        raise RequestError(f"'structured_outputs' must set exactly one of {', '.join(STRUCTURED_KINDS)}",
                           "structured_outputs", "invalid_value")
    kind = given[0]
    value, param = spec[kind], f"structured_outputs.{kind}"
    if compiler is None:
        raise RequestError("this model has no tokenizer: 'structured_outputs' needs one", "structured_outputs",
                           "no_tokenizer")
    import llguidance

    if kind == "json_object":
        if value is not True:
            raise RequestError(f"'{param}' must be true", param, "invalid_value")
        return compiler.json_schema(JSON_OBJECT_SCHEMA, kind, param)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise RequestError(f"'{param}' must be a JSON schema (an object or its JSON text)", param,
                                   "invalid_type") from None
        if not isinstance(value, dict):
            raise RequestError(f"'{param}' must be a JSON schema object", param, "invalid_type")
        return compiler.json_schema(value, kind, param)
    if kind == "choice":
        if not (isinstance(value, list) and 0 < len(value) <= MAX_CHOICES and all(isinstance(c, str) and c
                                                                                  for c in value)):
            raise RequestError(f"'{param}' must be a list of 1-{MAX_CHOICES} non-empty strings", param,
                               "invalid_type")
        lark = "start: " + " | ".join(json.dumps(c) for c in value)  # Lark's string literals are JSON strings
        return compiler.compile(llguidance.LLMatcher.grammar_from_lark(lark), kind, param)
    if not isinstance(value, str) or not value:
        raise RequestError(f"'{param}' must be a non-empty string", param, "invalid_type")
    grammar = llguidance.LLMatcher.grammar_from_regex(value) if kind == "regex" else \
        llguidance.LLMatcher.grammar_from_lark(value)
    return compiler.compile(grammar, kind, param)
