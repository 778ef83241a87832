"""StructuredOutputsParams: the shape a request's output must take (vLLM's name and fields).

Only the description lives here: checking it needs no grammar library, so an API front end can
refuse a bad request without xgrammar installed. sampling/grammar.py compiles it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import ConfigError

_ALLOWED = ("exactly one of json=<a JSON schema: dict or JSON text> or json_object=True "
            "(any JSON object)")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain the output to JSON: `json` a JSON schema (dict or its text), or `json_object`.

    Like vLLM's `StructuredOutputsParams`; regex, choice, grammar and structural_tag are not
    supported yet. The schema is kept as canonical JSON text (sorted keys), the cache key of its
    compiled grammar.
    """

    json: dict | str | None = None  # a JSON schema; after checking, its canonical JSON text
    json_object: bool | None = None  # any JSON object (OpenAI's response_format json_object)

    def __post_init__(self) -> None:
        if self.json_object not in (None, True, False):
            raise ConfigError(f"structured_outputs.json_object={self.json_object!r} is invalid; "
                              "allowed: True, False or None")
        if (self.json is None) == (not self.json_object):
            raise ConfigError(f"structured_outputs={self.describe()} is invalid; allowed: {_ALLOWED}")
        if self.json is not None:
            self.json = _canonical_schema(self.json)

    @classmethod
    def of(cls, value: object) -> StructuredOutputsParams:
        """value as StructuredOutputsParams: itself, or a dict of its fields (as it crosses Ray)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"json", "json_object"})
            if unknown:
                raise ConfigError(f"structured_outputs has unsupported field(s) {unknown}; allowed: {_ALLOWED}")
            return cls(**value)
        raise ConfigError(f"structured_outputs={value!r:.80} ({type(value).__name__}) is invalid; "
                          f"allowed: None, a StructuredOutputsParams or a dict with {_ALLOWED}")

    @property
    def key(self) -> str:
        """What identifies the compiled grammar: equal keys share one compile."""
        return "json_object" if self.json is None else self.json

    def describe(self) -> str:
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else repr(self.json)
            return f"json={text:.80}"
        return f"json_object={self.json_object!r}"


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
