"""What a tool call's text is made of, in the formats tool_parsers.py reads: a call (ParsedCall),
a `<tool_call>` block's body (one JSON call object, a list of them, or XML), and `{...}; {...}`
runs of JSON calls (Llama 3's, Mistral's before v11). Each reader returns None unless all of its
text is calls."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .xml_tool_calls import xml_calls

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # what OpenAI allows a function's name


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call the model wrote: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    text_values: bool = False  # every argument is text as written (XML calls): the tool's schema types them


def block_calls(body: str) -> list[ParsedCall] | None:
    """The calls in one `<tool_call>` block's body: an object, or a list of them (some fine-tunes
    write one block for all their calls), or Qwen3-Coder's `<function=...>` XML; None when it is
    not that (bad JSON, a call without a name)."""
    xml = xml_calls(body)
    if xml is not None:
        return text_valued(xml)
    try:
        items = json.loads(body)
    except ValueError:
        return None
    return call_items(items if isinstance(items, list) else [items])


def text_valued(found: list[tuple[str, dict[str, str]]]) -> list[ParsedCall] | None:
    """Calls whose argument values are text as written (XML and GLM calls); None if a name is not one."""
    if not all(FUNCTION_NAME.fullmatch(name) for name, _ in found):
        return None
    return [ParsedCall(name, json.dumps(arguments), text_values=True) for name, arguments in found]


def call_items(items: list) -> list[ParsedCall] | None:
    """Decoded call objects ({"name", "arguments" or "parameters"}) as calls; None unless all are."""
    if not items or not all(isinstance(item, dict) and isinstance(item.get("name"), str) for item in items):
        return None
    calls = []
    for item in items:
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append(ParsedCall(item["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
    return calls


def json_calls(text: str) -> list[ParsedCall] | None:
    """`{...}; {...}` (or JSON lists of such objects) as calls; None unless every part is a call object."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        found = call_items(item if isinstance(item, list) else [item])
        if found is None:
            return None
        calls += found
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
    return calls or None
