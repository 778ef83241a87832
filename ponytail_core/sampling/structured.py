"""StructuredOutputsParams: the shape a request's output must take (vLLM's name and fields).

Only the description lives here: checking it needs no grammar library, so an API front end can
refuse a bad request without xgrammar installed. sampling/grammar.py compiles it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import ConfigError

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_ALLOWED = ("exactly one of json=<a JSON schema: dict or JSON text>, regex=<a regular expression>, "
            "choice=<a list of strings>, grammar=<an EBNF grammar with a root rule> or json_object=True "
            "(any JSON object)")


@dataclass(slots=True)
class StructuredOutputsParams:
    """The shape the output must take: `json` a JSON schema (dict or its text), `regex`, `choice`
    (one of these strings, whole), `grammar` (EBNF/GBNF as xgrammar reads it, with a `root`
    rule), or `json_object` (any JSON object). Exactly one.

    Like vLLM's `StructuredOutputsParams`; structural_tag and the whitespace options are not
    supported. The schema is kept as canonical JSON text (sorted keys); `key` names the compiled
    grammar in the cache.
    """

    json: dict | str | None = None  # a JSON schema; after checking, its canonical JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None  # any JSON object (OpenAI's response_format json_object)

    def __post_init__(self) -> None:
        if self.json_object not in (None, True, False):
            raise ConfigError(f"structured_outputs.json_object={self.json_object!r} is invalid; "
                              "allowed: True, False or None")
        if len(self._given()) != 1:
            raise ConfigError(f"structured_outputs={self.describe()} is invalid; allowed: {_ALLOWED}")
        if self.json is not None:
            self.json = _canonical_schema(self.json)
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and not (isinstance(value, str) and value.strip()):
                raise ConfigError(f"structured_outputs.{kind}={value!r:.80} is invalid; allowed: a non-empty string")
        if self.choice is not None:
            choice = self.choice
            if not (isinstance(choice, (list, tuple)) and choice and all(isinstance(c, str) and c for c in choice)):
                raise ConfigError(f"structured_outputs.choice={choice!r:.80} is invalid; allowed: a non-empty list "
                                  "of non-empty strings")
            self.choice = list(choice)

    @classmethod
    def of(cls, value: object) -> StructuredOutputsParams:
        """value as StructuredOutputsParams: itself, or a dict of its fields (as it crosses Ray)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(_KINDS))
            if unknown:
                raise ConfigError(f"structured_outputs={value!r:.80} has unsupported field(s) {unknown}; "
                                  f"allowed: {_ALLOWED}")
            return cls(**value)
        raise ConfigError(f"structured_outputs={value!r:.80} ({type(value).__name__}) is invalid; "
                          f"allowed: None, a StructuredOutputsParams or a dict with {_ALLOWED}")

    def _given(self) -> list[str]:
        """The constraint fields that are set (one, once checked)."""
        return [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]

    @property
    def kind(self) -> str:
        """Which constraint this is: one of json, regex, choice, grammar, json_object."""
        return self._given()[0]

    @property
    def key(self) -> str:
        """What identifies the compiled grammar: equal keys share one compile."""
        kind = self.kind
        if kind == "json":
            return self.json  # canonical schema text, as before: a schema's key does not change
        if kind == "json_object":
            return "json_object"
        return f"{kind}:{json.dumps(getattr(self, kind))}"

    def ebnf(self) -> str | None:
        """The grammar to compile for grammar and choice (each choice a literal); None for the others."""
        if self.grammar is not None:
            return self.grammar
        if self.choice is not None:
            return "root ::= " + " | ".join(json.dumps(c) for c in self.choice)
        return None

    def describe(self) -> str:
        parts = []
        for kind in self._given():
            value = getattr(self, kind)
            text = value if isinstance(value, str) else repr(value)
            parts.append(f"{kind}={text:.80}")
        return ", ".join(parts) or "{}"


def _canonical_schema(schema: object) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ConfigError(f"structured_outputs.json={schema!r:.80} is not valid JSON ({exc}); "
                              "allowed: a JSON schema object") from None
    if isinstance(schema, bool) or not isinstance(schema, dict):
        raise ConfigError(f"structured_outputs.json={schema!r:.80} is invalid; allowed: a JSON schema object "
                          "(a dict such as {'type': 'object', ...})")
    try:
        return json.dumps(schema, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"structured_outputs.json cannot be written as JSON ({exc}); "
                          "allowed: a JSON schema of dicts, lists, strings, numbers, booleans and None") from None
