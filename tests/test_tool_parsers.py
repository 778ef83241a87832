"""Hermes tool calls in a model's free text (deployments/tool_parsers.py): whole and streamed alike."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.tool_parsers import HERMES, HermesCallStream, ParsedCall, parse_hermes, tool_call_format

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


def test_the_format_comes_from_the_chat_template():
    assert tool_call_format("{% for m in messages %}<tool_call>{{ m }}</tool_call>{% endfor %}") == HERMES
    assert tool_call_format({"default": "plain", "tool_use": "... <tool_call> ..."}) == HERMES
    assert tool_call_format("{{ messages[0].content }}") is None  # SmolLM2's kind: nothing to read
    assert tool_call_format(None) is None and tool_call_format({"default": None}) is None


def test_content_and_calls_are_split():
    content, calls = parse_hermes("Let me look.\n" + WEATHER + "\n" + TIME + "\n")
    assert content == "Let me look."  # the newlines before, between and after the calls are not content
    assert calls == [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("get_time", '{"zone": "UTC"}')]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}


def test_an_answer_of_calls_only_has_no_content():
    assert parse_hermes(WEATHER + "\n" + TIME) == (None, [ParsedCall("get_weather", '{"city": "Paris"}'),
                                                          ParsedCall("get_time", '{"zone": "UTC"}')])
    assert parse_hermes("  \n") == ("  \n", [])  # no calls: the text as written
    assert parse_hermes("a \nb\n") == ("a \nb\n", [])
    assert parse_hermes("a \n" + WEATHER + "b\n") == ("a \nb", [ParsedCall("get_weather", '{"city": "Paris"}')])
    assert parse_hermes("") == (None, [])


def test_what_is_not_a_call_stays_content():
    bad = "<tool_call>not json</tool_call>"
    assert parse_hermes("a " + bad + " b") == ("a " + bad + " b", [])
    assert parse_hermes('<tool_call>{"arguments": {}}</tool_call>')[1] == []  # no name
    assert parse_hermes("x <tool") == ("x <tool", [])  # a tag's start at the end: text after all
    assert parse_hermes("1 < 2 and <b>") == ("1 < 2 and <b>", [])


def test_an_unclosed_call_counts_when_its_json_is_whole():
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {"x": 1}}') == (None, [ParsedCall("f", '{"x": 1}')])
    assert parse_hermes('<tool_call>{"name": "f", "argu') == ('<tool_call>{"name": "f", "argu', [])  # cut short


def test_arguments_given_as_text_or_under_parameters():
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[1] == [
        ParsedCall("f", '{"x": 1}')]
    assert parse_hermes('<tool_call>{"name": "f", "parameters": {"y": 2}}</tool_call>')[1] == [
        ParsedCall("f", '{"y": 2}')]
    assert parse_hermes('<tool_call>{"name": "f"}</tool_call>')[1] == [ParsedCall("f", "{}")]


def test_one_block_may_hold_a_list_of_calls():
    block = '<tool_call>[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]</tool_call>'
    assert parse_hermes(block) == (None, [ParsedCall("f", '{"x": 1}'), ParsedCall("g", "{}")])
    assert parse_hermes("<tool_call>[]</tool_call>") == ("<tool_call>[]</tool_call>", [])
    assert parse_hermes('<tool_call>[{"name": "f"}, 3]</tool_call>')[1] == []  # not all calls: text


def streamed(pieces):
    stream = HermesCallStream()
    events = [event for piece in pieces for event in stream.feed(piece)] + stream.finish()
    content = "".join(value for kind, value in events if kind == "content")
    return (content or None), [value for kind, value in events if kind == "call"], events


TEXTS = st.lists(st.sampled_from(["Sure, ", "<", "tool", "_call", ">", WEATHER, TIME, "\n", " ", "x < y", "</tool_call>",
                                  '{"name": "g"}', "<tool_call>", "done."]), max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=TEXTS, cuts=st.lists(st.floats(min_value=0, max_value=1), max_size=8))
def test_a_stream_cut_anywhere_gives_the_whole_answer(text, cuts):
    bounds = sorted({0, len(text), *(int(c * len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    content, calls, events = streamed(pieces)
    assert (content, calls) == parse_hermes(text)
    # Nothing the model wrote is lost: the content plus the calls' blocks account for all but whitespace.
    assert all(kind == "call" or value for kind, value in events)


def test_content_before_a_call_streams_before_it_closes():
    stream = HermesCallStream()
    assert stream.feed("Checking the weather. <tool") == [("content", "Checking the weather.")]
    assert stream.feed('_call>{"name": "get_weather", "arguments": {}}') == []  # inside the block
    assert stream.feed("</tool_call>") == [("call", ParsedCall("get_weather", "{}"))]
    assert stream.feed("\n") == [] and stream.finish() == []  # trailing whitespace after a call
