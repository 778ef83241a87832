"""Qwen3-Coder's XML tool calls (vLLM's `qwen3_coder` / `qwen3_xml` parsers), read inside the
same `<tool_call>` blocks as Hermes JSON (tool_parsers.py), and GLM-4.5's (`glm_calls`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text (its wrapping newlines are markup); `typed_arguments` gives it the
type the tool's JSON schema declares (integer, number, boolean, object, array, null) where the text
reads as one, as vLLM converts by the schema. Without a declared type a value stays a string.
"""

from __future__ import annotations

import json
import re
from typing import Any

FUNCTION_TAG = "<function="  # in a chat template: it teaches this format
_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def xml_calls(body: str) -> list[tuple[str, dict[str, str]]] | None:
    """(function name, {parameter: text}) for each `<function=...>` in a block's body; None unless
    the body is only such functions (and whitespace). The names are as written (the caller checks them)."""
    if not body.lstrip().startswith(FUNCTION_TAG):
        return None
    calls, end = [], 0
    for match in _FUNCTION.finditer(body):
        if body[end:match.start()].strip():
            return None
        name = match.group(1).strip()
        inner, arguments, at = match.group(2), {}, 0
        for parameter in _PARAMETER.finditer(inner):
            if inner[at:parameter.start()].strip():
                return None
            arguments[parameter.group(1).strip()] = _unwrapped(parameter.group(2))
            at = parameter.end()
        if inner[at:].strip():
            return None
        calls.append((name, arguments))
        end = match.end()
    return calls if calls and not body[end:].strip() else None


ARG_KEY = "<arg_key>"  # in a chat template: it teaches GLM-4.5's format
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|\Z)", re.S)


def glm_calls(body: str) -> list[tuple[str, dict[str, str]]] | None:
    """GLM-4.5/4.6/4.7's call in a `<tool_call>` block (vLLM's `glm45` / `glm47` parsers): the
    function's name, then `<arg_key>k</arg_key><arg_value>v</arg_value>` pairs, one call a block;
    None unless the body is only that. Values are text, as written (typed by the tool's schema)."""
    at = body.find(ARG_KEY)
    name = (body if at < 0 else body[:at]).strip()
    if not name:
        return None
    arguments, end = {}, len(body) if at < 0 else at
    for match in _GLM_ARGUMENT.finditer(body, end):
        if body[end:match.start()].strip():
            return None
        arguments[match.group(1).strip()] = match.group(2)
        end = match.end()
    return [(name, arguments)] if not body[end:].strip() else None


def _unwrapped(value: str) -> str:
    """The value without the one newline the format puts on each side."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


_DECODED = {"integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list,
            "null": type(None)}


def typed_arguments(arguments: dict[str, Any], parameters: dict[str, Any] | None) -> dict[str, Any]:
    """Text values given the types the tool's parameters schema declares, where the text reads as
    that type (JSON, or Python's True/False/None as models also write); others as they are."""
    properties = (parameters or {}).get("properties") or {}
    typed = {}
    for name, value in arguments.items():
        declared = (properties.get(name) or {}).get("type") if isinstance(properties.get(name), dict) else None
        kinds = [declared] if isinstance(declared, str) else list(declared or [])
        typed[name] = _as_declared(value, [k for k in kinds if k in _DECODED]) if isinstance(value, str) else value
    return typed


def _as_declared(text: str, kinds: list[str]) -> Any:
    if not kinds:
        return text
    stripped = text.strip()
    candidates = [stripped, {"True": "true", "False": "false", "None": "null"}.get(stripped, stripped)]
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        for kind in kinds:
            wanted = _DECODED[kind]
            if isinstance(value, bool) and kind in ("integer", "number"):
                continue  # JSON true is no number
            if isinstance(value, wanted) and not (kind == "integer" and isinstance(value, float)):
                return value
    return text
