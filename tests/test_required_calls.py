"""tool_choice "required" read as it is generated (deployments/api/required_calls.py): wherever the
output is cut into deltas, each call's name comes once and its arguments' pieces join to its text."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.api.required_calls import RequiredCallStream

CALLS = [{"name": "get_weather", "parameters": {"city": 'Pa"ris, {x} \\ end', "unit": "celsius"}},
         {"name": "get_time", "parameters": {"zone": "UTC", "nested": {"a": [1, {"b": "]}"}]}}},
         {"name": "noop", "parameters": {}}]
OUTPUT = json.dumps(CALLS)  # the grammar writes compact JSON with ", " and ": ", as json.dumps does


def replay(pieces: list[str]) -> tuple[RequiredCallStream, dict[int, str], dict[int, str]]:
    stream, names, arguments = RequiredCallStream(), {}, {}
    for piece in pieces:
        for kind, index, value in stream.feed(piece):
            if kind == "name":
                assert index not in names and index not in arguments  # the name first, once
                names[index] = value
            else:
                assert index in names
                arguments[index] = arguments.get(index, "") + value
    return stream, names, arguments


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(OUTPUT)), max_size=30))
def test_every_cut_of_the_output_gives_the_same_calls(cuts):
    bounds = sorted({0, len(OUTPUT), *cuts})
    stream, names, arguments = replay([OUTPUT[a:b] for a, b in zip(bounds, bounds[1:])])
    assert stream.complete
    assert [names[i] for i in sorted(names)] == [c["name"] for c in CALLS]
    assert [json.loads(arguments.get(i, "")) for i in sorted(names)] == [c["parameters"] for c in CALLS]
    assert stream.whole_calls() == [(c["name"], json.dumps(c["parameters"])) for c in CALLS]


def test_parameters_before_the_name_go_out_right_after_it():
    text = '[{"parameters": {"x": 1}, "name": "f"}]'
    stream, names, arguments = replay([text[:20], text[20:]])
    assert names == {0: "f"} and arguments == {0: '{"x": 1}'} and stream.whole_calls() == [("f", '{"x": 1}')]


def test_a_list_cut_short_holds_only_its_whole_calls():
    cut = OUTPUT[: OUTPUT.index("get_time") + 20]
    stream, names, _ = replay([cut])
    assert not stream.complete and names == {0: "get_weather", 1: "get_time"}
    assert stream.whole_calls() == [("get_weather", json.dumps(CALLS[0]["parameters"]))]
