"""tool_choice "auto" through the API and the official openai client, over a backend that writes a script.

The served chat template writes Hermes (or Llama 3 JSON) tool calls (ModelInfo.tool_call_format),
the backend's output is fixed text cut into pieces, and the answer's calls and content must come
out the same whole and streamed. A template without a format refuses "auto" (tests/test_structured_api.py).
"""

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from deployments.app.local_server import serve_on_loopback  # noqa: E402
from deployments.api.server import build_app  # noqa: E402
from deployments.api.protocol import GenerateDelta, ModelInfo  # noqa: E402
from request_fields import sampling_set  # noqa: E402

MODEL = "hermes-model"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]
ANSWERED = ASK + [  # the model called get_weather, the client answered
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
TWO_CALLS = ["I will check.", "\n<tool", '_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
             'ris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>']


class ScriptedBackend:
    """Writes `script` (its pieces as deltas) for every request; records the requests."""

    def __init__(self, tool_call_format: str | None = "hermes"):
        self.tool_call_format = tool_call_format
        self.script: list[str] = []
        self.finish_reason = "stop"
        self.requests = []

    async def model_info(self) -> ModelInfo:
        return ModelInfo(model_id=MODEL, max_model_len=512, block_size=16, device="cpu", device_uuid=None,
                         tool_call_format=self.tool_call_format)

    def stream(self, request):
        self.requests.append(request)
        return self._deltas(request)

    async def _deltas(self, request):
        for i, piece in enumerate(self.script):
            done = i + 1 == len(self.script)
            yield GenerateDelta(request_id=request.request_id, text=piece, token_ids=[100 + i], finished=done,
                                finish_reason=self.finish_reason if done else None, prompt_tokens=10, completion_tokens=i + 1)

    async def abort(self, request_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def served():
    backend = ScriptedBackend()
    with serve_on_loopback(build_app(backend)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=5.0) as client:
            yield backend, client


def ask(client, stream=False, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", ASK),
                                          tools=[WEATHER, TIME], stream=stream, **kwargs)


def test_auto_returns_the_calls_the_model_wrote_and_its_text(served):
    backend, client = served
    backend.script = TWO_CALLS
    for choice_arg in ({}, {"tool_choice": "auto"}):  # OpenAI's default once tools are given, and said
        choice = ask(client, **choice_arg).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "I will check."
        first, second = choice.message.tool_calls
        assert (first.function.name, json.loads(first.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert (second.function.name, second.function.arguments) == ("get_time", "{}")
        assert first.id.startswith("call_") and first.id != second.id and first.type == "function"
    request = backend.requests[-1]
    assert [t["function"]["name"] for t in request.tools] == ["get_weather", "get_time"]  # for the template
    assert "structured_outputs" not in sampling_set(request)  # the model decides: nothing constrains it
    assert sampling_set(request)["skip_special_tokens"] is False  # tags some tokenizers mark special stay in


def test_a_streamed_auto_answer_matches_the_whole_one(served):
    backend, client = served
    backend.script = TWO_CALLS
    chunks = [c for c in ask(client, stream=True) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert content == "I will check."
    # each call's name as soon as its arguments open, then its arguments in the pieces the model wrote
    assert [(d.index, d.function.name, d.function.arguments) for d in calls] == [
        (0, "get_weather", ""), (0, None, '{"city": "Pa'), (0, None, 'ris"}'), (1, "get_time", ""), (1, None, "{}")]
    assert [bool(d.id and d.type == "function") for d in calls] == [True, False, False, True, False]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    whole = ask(client).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in whole] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


def test_an_auto_call_cut_by_max_tokens_finishes_length_streamed_and_whole(served):
    backend, client = served
    backend.script = ["<tool_call>\n", '{"name": "get_weather", "arguments": {"city": "Pa']
    backend.finish_reason = "length"
    try:
        chunks = [c for c in ask(client, stream=True) if c.choices]
        choice = ask(client).choices[0]
    finally:
        backend.finish_reason = "stop"
    arguments = "".join(d.function.arguments for c in chunks for d in (c.choices[0].delta.tool_calls or []))
    assert arguments == '{"city": "Pa' and chunks[-1].choices[0].finish_reason == "length"
    assert choice.finish_reason == "length"  # the arguments are as far as they were written
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Pa')]


def test_qwen3_coder_xml_calls_come_back_typed_by_the_tools_schema(served):
    """Qwen3-Coder's <function=...> calls in the same blocks: text values get the schema's types."""
    backend, client = served
    forecast = {"type": "function", "function": {"name": "forecast", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"}}}}}
    backend.script = ["Looking.\n<tool_call>\n<function=forecast>\n<parameter=city>\n", "2046\n</parameter>\n",
                      "<parameter=days>\n3\n</parameter>\n<parameter=hourly>\nfalse\n</parameter>\n</function>\n",
                      "</tool_call>"]
    expected = {"city": "2046", "days": 3, "hourly": False}  # "2046" is a string: the schema says so
    choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=[forecast]).choices[0]
    (call,) = choice.message.tool_calls
    assert (choice.message.content, call.function.name, json.loads(call.function.arguments)) == (
        "Looking.", "forecast", expected)
    chunks = [c for c in client.chat.completions.create(model=MODEL, messages=ASK, tools=[forecast], stream=True)
              if c.choices]
    (delta,) = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert json.loads(delta.function.arguments) == expected and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_glm_calls_come_back_typed_by_the_tools_schema():
    """GLM-4.5's name + <arg_key>/<arg_value> calls: text values get the schema's types, streamed too."""
    backend = ScriptedBackend(tool_call_format="glm45")
    forecast = {"type": "function", "function": {"name": "forecast", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}
    backend.script = ["Looking.<tool_call>forecast\n<arg_key>city</arg_key>\n<arg_value>2046", "</arg_value>\n",
                      "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"]
    with serve_on_loopback(build_app(backend)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=5.0) as client:
            choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=[forecast]).choices[0]
            chunks = [c for c in client.chat.completions.create(model=MODEL, messages=ASK, tools=[forecast],
                                                                stream=True) if c.choices]
    (call,) = choice.message.tool_calls
    assert (choice.message.content, call.function.name, json.loads(call.function.arguments)) == (
        "Looking.", "forecast", {"city": "2046", "days": 3})
    (delta,) = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert json.loads(delta.function.arguments) == {"city": "2046", "days": 3}


def test_parallel_tool_calls_false_keeps_the_first_call(served):
    backend, client = served
    backend.script = TWO_CALLS
    whole = ask(client, parallel_tool_calls=False).choices[0].message.tool_calls
    assert [c.function.name for c in whole] == ["get_weather"]
    chunks = [c for c in ask(client, stream=True, parallel_tool_calls=False) if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather"), (0, None), (0, None)]
    assert "".join(d.function.arguments for d in deltas) == '{"city": "Paris"}'  # the second call's: none


def test_an_answer_without_calls_is_plain_text(served):
    backend, client = served
    backend.script = ["It is ", "sunny in Paris; 1 < 2."]
    choice = ask(client).choices[0]
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == (
        "stop", "It is sunny in Paris; 1 < 2.", None)
    chunks = [c for c in ask(client, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "It is sunny in Paris; 1 < 2."
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_earlier_calls_reach_a_tool_format_template_as_objects(served):
    backend, client = served
    backend.script = ["18 degrees."]
    messages = ANSWERED
    assert ask(client, messages=messages).choices[0].message.content == "18 degrees."
    assistant = backend.requests[-1].messages[1]
    # Not written into the content as JSON (the template shows the call itself), and its arguments
    # an object, which such templates write with tojson (text would be quoted twice).
    assert not assistant.get("content")
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_a_template_without_a_format_refuses_auto_naming_the_field():
    backend = ScriptedBackend(tool_call_format=None)
    with serve_on_loopback(build_app(backend)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=5.0) as client:
            with pytest.raises(openai.BadRequestError) as caught:
                ask(client, tool_choice="auto")
    body = caught.value.body
    assert body["param"] == "tool_choice"
    assert "no tool-call format" in body["message"] and "<tool_call>" in body["message"]
    assert "'required'" in body["message"]  # what is allowed instead
    assert not backend.requests


def test_llama3_json_calls_whole_and_streamed():
    backend = ScriptedBackend(tool_call_format="llama3_json")
    backend.script = ["<|python_tag|>", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
                      '; {"name": "get_time", "parameters": {}}']
    with serve_on_loopback(build_app(backend)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=5.0) as client:
            choice = ask(client).choices[0]
            chunks = [c for c in ask(client, stream=True) if c.choices]
            backend.script = ["Paris ", "is sunny."]
            text = ask(client).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    streamed = [(d.function.name, d.function.arguments) for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert streamed == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (text.finish_reason, text.message.content, text.message.tool_calls) == ("stop", "Paris is sunny.", None)


def test_mistral_calls_get_nine_character_ids_and_earlier_ids_are_made_so():
    """Mistral's templates raise on any call id but 9 letters or digits: calls get such ids there
    ('auto', 'required' or named), and an earlier call's id of another shape reaches the template as one digest, the same
    in the assistant's call and in the tool message that answers it."""
    backend = ScriptedBackend(tool_call_format="mistral")
    backend.script = ["[TOOL_CALLS]", 'get_weather[ARGS]{"city": "Paris"}', '[TOOL_CALLS]get_time[ARGS]{}']
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0123456789abcdef", "type": "function",
                                                               "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "noon"}]
    with serve_on_loopback(build_app(backend)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=5.0) as client:
            whole = ask(client, messages=history).choices[0]
            chunks = [c for c in ask(client, stream=True) if c.choices]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    streamed = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name) for d in streamed] == [(0, "get_weather"), (1, "get_time")]
    for call in whole.message.tool_calls + streamed:
        assert len(call.id) == 9 and call.id.isalnum(), call.id
    backend.script = ['[{"name": "get_time", "parameters": {}}]']  # a forced choice, constrained JSON
    with serve_on_loopback(build_app(backend)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=5.0) as client:
            forced = ask(client, tool_choice="required").choices[0].message.tool_calls
            named = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c.function.name for c in forced] == ["get_time"]
    for call in forced + named.choices[0].message.tool_calls:
        assert len(call.id) == 9 and call.id.isalnum(), call.id  # the same ids whatever the choice
    earlier = backend.requests[0].messages
    call_id = earlier[1]["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum() and earlier[2]["tool_call_id"] == call_id
    assert earlier[1]["tool_calls"][0]["function"]["arguments"] == {}  # an object, as with the other formats


def test_earlier_calls_reach_the_template_as_objects_without_tools_in_the_request(served):
    """A follow-up that leaves the tools out (the model is to answer, not call) still renders the
    history's calls as the template writes them."""
    backend, client = served
    backend.script = ["18 degrees."]
    messages = ANSWERED
    answer = client.chat.completions.create(model=MODEL, messages=messages).choices[0]
    assert answer.message.content == "18 degrees."
    request = backend.requests[-1]
    assert not request.tools and request.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert request.messages[1]["tool_calls"][0]["id"] == "call_1"  # other formats keep the client's ids


def test_pythonic_calls_when_the_operator_sets_the_parser():
    backend = ScriptedBackend(tool_call_format="pythonic")  # what tool_call_parser: pythonic serves
    backend.script = ["[get_weather(", 'city="Paris"), get_time()]']
    with serve_on_loopback(build_app(backend)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=5.0) as client:
            whole = ask(client).choices[0]
            chunks = [c for c in ask(client, stream=True) if c.choices]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert [(d.function.name, d.function.arguments) for c in chunks for d in (c.choices[0].delta.tool_calls or [])] \
        == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
