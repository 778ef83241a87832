"""Tool calls in a model's free text (deployments/tool_parsers.py): whole and streamed alike."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.api.tool_parsers import (GLM45, HERMES, LLAMA3_JSON, MISTRAL, PYTHON_TAG, PYTHONIC, TOOL_CALLS,
                                          HermesCallStream, ParsedCall, call_stream, parse, served_tool_call_format,
                                          tool_call_format)

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


def hermes(text):
    return parse(HERMES, text)


def llama3(text):
    return parse(LLAMA3_JSON, text)


def test_the_format_comes_from_the_chat_template():
    assert tool_call_format("{% for m in messages %}<tool_call>{{ m }}</tool_call>{% endfor %}") == HERMES
    assert tool_call_format({"default": "plain", "tool_use": "... <tool_call> ..."}) == HERMES
    assert tool_call_format("{{ messages[0].content }}") is None  # SmolLM2's kind: nothing to read
    assert tool_call_format("{%- if builtin_tools %}<|python_tag|>{% endif %}") == LLAMA3_JSON
    assert tool_call_format(None) is None and tool_call_format({"default": None}) is None


def test_content_and_calls_are_split():
    content, calls = hermes("Let me look.\n" + WEATHER + "\n" + TIME + "\n")
    assert content == "Let me look."  # the newlines before, between and after the calls are not content
    assert calls == [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("get_time", '{"zone": "UTC"}')]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}


def test_an_answer_of_calls_only_has_no_content():
    assert hermes(WEATHER + "\n" + TIME) == (None, [ParsedCall("get_weather", '{"city": "Paris"}'),
                                                          ParsedCall("get_time", '{"zone": "UTC"}')])
    assert hermes("  \n") == ("  \n", [])  # no calls: the text as written
    assert hermes("a \nb\n") == ("a \nb\n", [])
    assert hermes("a \n" + WEATHER + "b\n") == ("a \nb", [ParsedCall("get_weather", '{"city": "Paris"}')])
    assert hermes("") == (None, [])


def test_what_is_not_a_call_stays_content():
    bad = "<tool_call>not json</tool_call>"
    assert hermes("a " + bad + " b") == ("a " + bad + " b", [])
    assert hermes('<tool_call>{"arguments": {}}</tool_call>')[1] == []  # no name
    assert hermes("x <tool") == ("x <tool", [])  # a tag's start at the end: text after all
    assert hermes("1 < 2 and <b>") == ("1 < 2 and <b>", [])


def test_an_unclosed_call_counts_when_its_json_is_whole():
    assert hermes('<tool_call>{"name": "f", "arguments": {"x": 1}}') == (None, [ParsedCall("f", '{"x": 1}')])
    assert hermes('<tool_call>{"name": "f", "argu') == ('<tool_call>{"name": "f", "argu', [])  # cut short


def test_arguments_given_as_text_or_under_parameters():
    assert hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[1] == [
        ParsedCall("f", '{"x": 1}')]
    assert hermes('<tool_call>{"name": "f", "parameters": {"y": 2}}</tool_call>')[1] == [
        ParsedCall("f", '{"y": 2}')]
    assert hermes('<tool_call>{"name": "f"}</tool_call>')[1] == [ParsedCall("f", "{}")]


def test_one_block_may_hold_a_list_of_calls():
    block = '<tool_call>[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]</tool_call>'
    assert hermes(block) == (None, [ParsedCall("f", '{"x": 1}'), ParsedCall("g", "{}")])
    assert hermes("<tool_call>[]</tool_call>") == ("<tool_call>[]</tool_call>", [])
    assert hermes('<tool_call>[{"name": "f"}, 3]</tool_call>')[1] == []  # not all calls: text


def streamed(pieces, fmt=HERMES):
    """(content, calls, events) of `pieces` fed one by one; a call streamed as it was written
    (call_name, call_arguments pieces, call_done) must add up to the call it ends with."""
    stream = call_stream(fmt)
    events = [event for piece in pieces for event in stream.feed(piece)] + stream.finish()
    content = "".join(value for kind, value in events if kind == "content")
    calls, writing = [], None
    for kind, value in events:
        if kind == "call_name":
            assert writing is None
            writing = [value, ""]
        elif kind == "call_arguments":
            writing[1] += value
        elif kind == "call_done":
            assert [value.name, value.arguments] == writing
            calls.append(value)
            writing = None
        elif kind == "call":
            assert writing is None
            calls.append(value)
    return (content or None), calls, events


XML_WEATHER = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
               "</parameter>\n</function>\n</tool_call>")


def test_qwen3_coder_xml_calls_are_read_in_the_same_blocks():
    content, calls = hermes("Checking.\n" + XML_WEATHER + "\n" + TIME)
    assert content == "Checking."
    assert calls == [ParsedCall("get_weather", '{"city": "New York", "days": "3"}', text_values=True),
                     ParsedCall("get_time", '{"zone": "UTC"}')]
    two = "<tool_call>\n<function=f>\n</function>\n<function=g>\n<parameter=a>\nx\ny\n</parameter>\n</function>\n"
    assert hermes(two + "</tool_call>")[1] == [ParsedCall("f", "{}", text_values=True),
                                               ParsedCall("g", '{"a": "x\\ny"}', text_values=True)]
    # unclosed tags at the end of an answer cut short still count, as vLLM reads them
    assert hermes("<tool_call>\n<function=f>\n<parameter=a>\n1")[1] == [ParsedCall("f", '{"a": "1"}', True)]
    for bad in ("<tool_call><function=f>text<parameter=a>1</parameter></function></tool_call>",
                "<tool_call><function=bad name!></function></tool_call>",
                "<tool_call><function=f></function> trailing</tool_call>"):
        assert hermes(bad) == (bad, []), bad


GLM_WEATHER = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n"
               "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")


def test_glm_calls_are_a_name_and_key_value_pairs_in_the_same_blocks():
    glm_template = "{% for tc in m.tool_calls %}<tool_call>{{ tc.name }}<arg_key>{{ k }}</arg_key>{% endfor %}"
    assert tool_call_format(glm_template) == GLM45  # GLM's template shows <tool_call> too: <arg_key> decides
    assert served_tool_call_format("glm47", None) == served_tool_call_format("glm45", None) == GLM45
    content, calls = parse(GLM45, "Checking.\n" + GLM_WEATHER + "<tool_call>get_time</tool_call>")
    assert content == "Checking."
    assert calls == [ParsedCall("get_weather", '{"city": "New York", "days": "3"}', text_values=True),
                     ParsedCall("get_time", "{}", text_values=True)]
    compact = "<tool_call>f<arg_key>a</arg_key><arg_value> x\ny </arg_value></tool_call>"  # GLM-4.7 writes no newlines
    assert parse(GLM45, compact)[1] == [ParsedCall("f", '{"a": " x\\ny "}', text_values=True)]
    assert parse(GLM45, WEATHER)[1] == hermes(WEATHER)[1]  # a JSON body reads as Hermes'
    assert parse(GLM45, "<tool_call>f<arg_key>a</arg_key><arg_value>1")[1] == [ParsedCall("f", '{"a": "1"}', True)]
    for bad in ("<tool_call>bad name</tool_call>", "<tool_call>f<arg_key>a</arg_key>junk</tool_call>",
                "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value> trailing</tool_call>",
                "<tool_call></tool_call>"):
        assert parse(GLM45, bad) == (bad, []), bad
    assert hermes(GLM_WEATHER) == (GLM_WEATHER, [])  # a Hermes model's block of text is no call


def test_xml_values_take_the_types_the_tools_schema_declares():
    from deployments.api.xml_tool_calls import typed_arguments

    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"}, "tags": {"type": "array"},
        "opts": {"type": "object"}, "zip": {"type": "string"}, "either": {"type": ["integer", "string"]}}}
    text = {"n": "3", "x": "2.5", "ok": "True", "tags": '["a", "b"]', "opts": '{"k": 1}', "zip": "01234",
            "either": "7", "free": "12"}
    assert typed_arguments(text, schema) == {"n": 3, "x": 2.5, "ok": True, "tags": ["a", "b"], "opts": {"k": 1},
                                             "zip": "01234", "either": 7, "free": "12"}
    wrong = {"n": "three", "x": "true", "ok": "1", "tags": "a, b", "n2": "4.0"}
    assert typed_arguments(wrong, schema) == wrong  # text that is not the declared type stays text
    assert typed_arguments({"n": "4.0"}, schema) == {"n": "4.0"}  # no integer
    assert typed_arguments({"a": "1"}, None) == {"a": "1"}


TEXTS = st.lists(st.sampled_from(["Sure, ", "<", "tool", "_call", ">", WEATHER, TIME, "\n", " ", "x < y", "</tool_call>",
                                  '{"name": "g"}', "<tool_call>", "done.", XML_WEATHER, "<function=f>",
                                  "<parameter=a>", "</parameter>", "</function>"]), max_size=12).map("".join)


LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA3_TEXTS = st.lists(st.sampled_from([" ", "\n", PYTHON_TAG, "<|py", LLAMA3_CALL, "; ", "{", "}", "Sure", '"x"',
                                         '{"name": "f"}']), max_size=8).map("".join)


MISTRAL_TEXTS = st.lists(st.sampled_from([" ", "\n", "Sure.", TOOL_CALLS, "[TOOL", "_CALLS]", "get_weather", "[ARGS]",
                                          '{"city": "Paris"}', '[{"name": "f", "arguments": {}}]', "{", "x"]),
                         max_size=10).map("".join)


GLM_TEXTS = st.lists(st.sampled_from(["Sure, ", "<tool_call>", "</tool_call>", "get_time", "<arg_key>", "city",
                                      "</arg_key>", "<arg_value>", "Paris", "</arg_value>", "\n", " ", GLM_WEATHER,
                                      WEATHER, "<tool", "_call>", "</arg"]), max_size=12).map("".join)


PYTHONIC_TEXTS = st.lists(st.sampled_from([" ", "\n", "[", "]", "get_weather(", 'city="Paris"', ")", ", ", "get_time()",
                                           "<|python_start|>", "<|python", "<|python_end|>", "Sure", "x=1"]),
                          max_size=10).map("".join)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), cuts=st.lists(st.floats(min_value=0, max_value=1), max_size=8))
def test_a_stream_cut_anywhere_gives_the_whole_answer(data, cuts):
    fmt = data.draw(st.sampled_from([HERMES, LLAMA3_JSON, MISTRAL, PYTHONIC, GLM45]))
    text = data.draw({HERMES: TEXTS, LLAMA3_JSON: LLAMA3_TEXTS, MISTRAL: MISTRAL_TEXTS, PYTHONIC: PYTHONIC_TEXTS,
                      GLM45: GLM_TEXTS}[fmt])
    bounds = sorted({0, len(text), *(int(c * len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    content, calls, events = streamed(pieces, fmt)
    assert (content, calls) == parse(fmt, text)
    # Nothing the model wrote is lost: the content plus the calls' blocks account for all but whitespace.
    assert all(kind in ("call", "call_done") or value for kind, value in events)


@settings(max_examples=200, deadline=None)
@given(text=TEXTS)
def test_a_stream_fed_one_character_at_a_time_gives_the_whole_answer(text):
    content, calls, _ = streamed(list(text))
    assert (content, calls) == parse(HERMES, text)


def test_content_before_a_call_streams_before_it_closes():
    stream = HermesCallStream()
    assert stream.feed("Checking the weather. <tool") == [("content", "Checking the weather.")]
    assert stream.feed('_call>{"name": "get_weather", "arguments": {}}') == [  # its name, then its arguments
        ("call_name", "get_weather"), ("call_arguments", "{}")]
    assert stream.feed("</tool_call>") == [("call_done", ParsedCall("get_weather", "{}"))]
    assert stream.feed("\n") == [] and stream.finish() == []  # trailing whitespace after a call


def test_a_calls_arguments_stream_in_pieces_as_the_model_writes_them():
    stream = HermesCallStream()
    pieces = ["<tool_call>\n", '{"name": "get_', 'weather", "arguments": ', '{"city": "Pa', 'ris", "note": "a } in ',
              'a \\" string", "days": [1, {"x": 2}]', "}}\n</tool", "_call>"]
    events = [stream.feed(piece) for piece in pieces]
    assert events[:3] == [[], [], []]  # the name goes out once the arguments open
    assert events[3] == [("call_name", "get_weather"), ("call_arguments", '{"city": "Pa')]
    assert events[4:6] == [[("call_arguments", 'ris", "note": "a } in ')],
                           [("call_arguments", 'a \\" string", "days": [1, {"x": 2}]')]]
    assert events[6] == [("call_arguments", "}")]  # the object's own brace; the call object's is not sent
    arguments = '{"city": "Paris", "note": "a } in a \\" string", "days": [1, {"x": 2}]}'
    assert events[7] == [("call_done", ParsedCall("get_weather", arguments))]
    assert json.loads(arguments)["note"] == 'a } in a " string'


def test_a_call_cut_short_inside_its_arguments_is_still_the_call_it_began():
    stream = HermesCallStream()
    events = stream.feed('<tool_call>{"name": "f", "arguments": {"a": "unfini') + stream.finish()
    assert events == [("call_name", "f"), ("call_arguments", '{"a": "unfini'),
                      ("call_done", ParsedCall("f", '{"a": "unfini'))]
    assert stream.cut_call
    closed = HermesCallStream()
    closed.feed('<tool_call>{"name": "f", "arguments": {}}')
    closed.finish()
    assert not closed.cut_call  # its arguments were whole; only the block's end tag is missing


def test_other_block_bodies_are_read_whole():
    for body in ['[{"name": "f", "arguments": {}}]', '{"arguments": {}, "name": "f"}', XML_WEATHER[11:-12]]:
        stream = HermesCallStream()
        events = stream.feed("<tool_call>" + body) + stream.feed("</tool_call>")
        assert [kind for kind, _ in events] == ["call"], body


def test_llama3_json_calls_are_the_whole_answer():
    assert llama3(LLAMA3_CALL) == (None, [ParsedCall("get_weather", '{"city": "Paris"}')])
    two = PYTHON_TAG + LLAMA3_CALL + '; {"name": "get_time", "parameters": {}}'
    assert llama3(two) == (None, [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("get_time", "{}")])
    assert llama3("\n" + PYTHON_TAG + " " + LLAMA3_CALL + " ")[1] == [ParsedCall("get_weather", '{"city": "Paris"}')]
    assert llama3(" Paris is sunny.") == (" Paris is sunny.", [])
    assert llama3('{"city": "Paris"}') == ('{"city": "Paris"}', [])  # JSON, but not a call: text as written
    assert llama3(LLAMA3_CALL + " and more") == (LLAMA3_CALL + " and more", [])


def test_llama3_text_streams_at_once_and_calls_wait_for_the_end():
    text = call_stream(LLAMA3_JSON)
    assert text.feed(" ") == [] and text.feed("It is") == [("content", " It is")]
    assert text.feed(" sunny") == [("content", " sunny")] and text.finish() == []
    call = call_stream(LLAMA3_JSON)
    assert call.feed("<|py") == [] and call.feed('thon_tag|>{"name": "f", ') == []
    assert call.feed('"parameters": {}}') == [] and call.finish() == [("call", ParsedCall("f", "{}"))]


def mistral(text):
    return parse(MISTRAL, text)


def test_mistral_calls_before_and_from_v11():
    weather = ParsedCall("get_weather", '{"city": "Paris"}')
    assert tool_call_format("{{ '[AVAILABLE_TOOLS]' }}{% if m.tool_calls %}[TOOL_CALLS] [{% endif %}") == MISTRAL
    # Before v11 (Mistral-7B-Instruct-v0.3): one JSON list after the tag.
    assert mistral('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                   '{"name": "get_time", "arguments": {}}]') == (None, [weather, ParsedCall("get_time", "{}")])
    # v11 and later: name[ARGS]{...} per tag, or name{...}; a call id after the name is skipped.
    assert mistral('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}') == (
        None, [weather, ParsedCall("get_time", "{}")])
    assert mistral('[TOOL_CALLS]get_weather{"city": "Paris"}')[1] == [weather]
    assert mistral('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}')[1] == [weather]
    assert mistral('Checking.  [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}') == ("Checking.", [weather])
    # Not calls: the text as written, whitespace and tag included.
    for text in ["Paris is sunny. ", "a [TOOL_CALLS] b", "Sure. [TOOL_CALLS] I think {\"a\": 1}",
                 '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', "[TOOL_CALLS]", '[TOOL_CALLS] [{"arguments": {}}]',
                 '[TOOL_CALLS]f[ARGS][1, 2]', "x [TOOL_CALL"]:
        assert mistral(text) == (text, []), text


def test_mistral_text_streams_until_the_tag():
    stream = call_stream(MISTRAL)
    assert stream.feed("It is ") == [("content", "It is")]  # trailing whitespace waits
    assert stream.feed("sunny [TOOL") == [("content", " sunny")]  # so does a tag's start
    assert stream.feed("_CALLS]get_weather[ARGS]") == [] and stream.feed('{"city": "Paris"}') == []
    assert stream.finish() == [("call", ParsedCall("get_weather", '{"city": "Paris"}'))]


def test_pythonic_calls_are_read_never_run():
    assert parse(PYTHONIC, '[get_weather(city="Paris"), get_time()]') == (
        None, [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("get_time", "{}")])
    assert parse(PYTHONIC, '<|python_start|>[f(a=1, b=[True, None], c={"k": 2.5})]<|python_end|>')[1] == [
        ParsedCall("f", '{"a": 1, "b": [true, null], "c": {"k": 2.5}}')]
    # Not calls, so text as written: positional or non-literal arguments, attributes, nothing callable.
    for text in ['[f("x")]', '[os.system("ls")]', '[f(a=open("x"))]', "[f(a=g())]", "[1, 2]", "[]", "[f(**k)]",
                 "[f(a={1, 2})]", "[f(a=1e999)]", " It is sunny.", "[f(a=1)] and more", "[f(a=1"]:
        assert parse(PYTHONIC, text) == (text, []), text
    stream = call_stream(PYTHONIC)
    assert stream.feed("It ") == [("content", "It ")] and stream.feed("is") == [("content", "is")]
