"""OpenAI's Responses API (POST /v1/responses) through the official openai client: a request's
input items, instructions, tools and text format run as the chat request they mean, and the
answer comes back as Response output items, whole or as the Responses event stream."""

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from deployments.app.local_server import serve_on_loopback  # noqa: E402
from deployments.api.server import build_app  # noqa: E402
from deployments.api.protocol import GenerateDelta  # noqa: E402
from deployments.api.reasoning import QWEN3  # noqa: E402
from test_reasoning import THOUGHT, ReasoningBackend  # noqa: E402
from test_tool_choice_auto import MODEL  # noqa: E402
from request_fields import sampling_set  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = ["Let me check.</think>\n\n", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "\n</tool_call>"]


class CuttingBackend(ReasoningBackend):
    """Finishes with finish_reason `finish` (length: max_output_tokens hit), or fails mid-stream."""

    finish = "stop"
    fail = False

    async def _deltas(self, request):
        for i, piece in enumerate(self.script):
            done = i + 1 == len(self.script)
            if done and self.fail:
                raise RuntimeError("engine gone")
            yield GenerateDelta(request_id=request.request_id, text=piece, token_ids=[100 + i], finished=done,
                                finish_reason=self.finish if done else None, prompt_tokens=10,
                                completion_tokens=i + 1)


@pytest.fixture()
def served():
    backend = CuttingBackend(QWEN3)
    with serve_on_loopback(build_app(backend)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=5.0) as client:
            yield backend, client


def test_a_string_input_with_instructions_answers_with_reasoning_and_a_message(served):
    backend, client = served
    backend.script = THOUGHT
    response = client.responses.create(model=MODEL, input="Capital of France?", instructions="Be brief.",
                                       max_output_tokens=20, temperature=0.5)
    assert response.output_text == "Paris." and response.status == "completed"
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "The user asks for France's capital."
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (10, 7, 17)
    assert (response.max_output_tokens, response.temperature, response.instructions) == (20, 0.5, "Be brief.")
    request = backend.requests[-1]
    assert request.messages == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Capital of France?"}]
    assert sampling_set(request)["max_tokens"] == 20 and sampling_set(request)["temperature"] == 0.5


def test_the_stream_is_the_responses_event_sequence_and_ends_as_the_whole_answer(served):
    backend, client = served
    backend.script = THOUGHT
    whole = client.responses.create(model=MODEL, input="Capital of France?")
    with client.responses.stream(model=MODEL, input="Capital of France?") as stream:  # the SDK checks the order
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Paris."
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == whole.output[0].content[0].text
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert [o.type for o in final.output] == [o.type for o in whole.output] == ["reasoning", "message"]


def test_function_tools_run_as_chat_tools_and_calls_come_back_as_items(served):
    backend, client = served
    backend.script = CALL
    response = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER])
    reasoning, call = response.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    assert call.call_id and call.id.startswith("fc_") and reasoning.content[0].text == "Let me check."
    request = backend.requests[-1]
    assert request.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER["parameters"]}}]
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=[WEATHER]) as stream:
        events = list(stream)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
    client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER],
                            tool_choice={"type": "function", "name": "get_weather"})
    assert "structured_outputs" in sampling_set(backend.requests[-1])  # a forced call: its arguments' schema binds


def test_a_conversation_of_items_becomes_the_chat_it_records(served):
    """Earlier calls, their outputs and reasoning, as the Agents SDK sends them back."""
    backend, client = served
    backend.script = ["</think>It is sunny."]
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                             "text": "Need the tool."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 18 C"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
             {"role": "developer", "content": "Answer in one sentence."}]
    response = client.responses.create(model=MODEL, input=items, tools=[WEATHER])
    assert response.output_text == "It is sunny."
    assert backend.requests[-1].messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 18 C", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "developer", "content": "Answer in one sentence."}]


def test_text_format_json_schema_binds_the_answer(served):
    backend, client = served
    backend.script = ['{"city": "Paris"}']
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    response = client.responses.create(model=MODEL, input="City?", text={"format": {
        "type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    assert json.loads(response.output_text) == {"city": "Paris"}  # grammar-bound: not split as thought
    assert sampling_set(backend.requests[-1])["structured_outputs"] == {"json": schema}
    assert response.text.format.type == "json_schema"


def test_max_output_tokens_hit_is_an_incomplete_response(served):
    backend, client = served
    backend.script, backend.finish = ["</think>Par", "is"], "length"
    response = client.responses.create(model=MODEL, input="Capital?", max_output_tokens=2)
    assert (response.status, response.incomplete_details.reason, response.output_text) == (
        "incomplete", "max_output_tokens", "Paris")
    with client.responses.stream(model=MODEL, input="Capital?", max_output_tokens=2) as stream:
        kinds = [e.type for e in stream]
    assert kinds[-1] == "response.incomplete"


def test_an_engine_failure_mid_stream_is_an_error_event(served):
    backend, client = served
    backend.script, backend.fail = ["</think>Par", "is"], True
    events = list(client.responses.create(model=MODEL, input="Capital?", stream=True))
    assert events[-2].type == "error" and "internal server error" in events[-2].message
    assert events[-1].type == "response.failed" and events[-1].response.error.message == events[-2].message
    assert not any(e.type == "response.completed" for e in events)


@pytest.mark.parametrize("body, param, words", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "tools[0].type='web_search' is not supported"),
    ({"input": [{"type": "image_generation_call"}]}, "input", "input[0].type='image_generation_call'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "input[0].content[0].type='input_image' is not supported"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", "input[0].role='robot' is invalid"),
    ({"input": "x", "max_output_tokens": "ten"}, "max_output_tokens", "valid integer"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "no json_schema.schema"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort", "none"),
    ({}, "input", "Field required"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input",
     "input[0].call_id=None is invalid; allowed: a non-empty string"),
    ({"input": [{"role": "user", "content": 3}]}, "input", "input[0].content=3 is invalid; allowed: a string"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "web_search"}}, "tool_choice",
     "tool_choice={'type': 'web_search'} is not supported; allowed: auto, none, required"),
    ({"input": "x", "n": 2}, "n", "a response is one answer"),
])
def test_what_this_server_cannot_do_is_a_400_naming_the_field(served, body, param, words):
    backend, client = served
    before = len(backend.requests)
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/responses", body={"model": MODEL, **body}, cast_to=object)
    error = caught.value.body
    assert error["param"] == param and words in error["message"], error
    assert len(backend.requests) == before


def test_a_body_that_is_not_json_is_a_400_that_says_so(served):
    import urllib.error
    import urllib.request

    _, client = served
    request = urllib.request.Request(str(client.base_url) + "responses", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=5)
    assert caught.value.code == 400
    assert json.loads(caught.value.read())["error"]["message"].startswith("the body is not valid JSON")


def test_stored_responses_are_404s_that_say_none_are_kept(served):
    _, client = served
    for call in (lambda: client.responses.retrieve("resp_1"), lambda: client.responses.delete("resp_1"),
                 lambda: client.responses.cancel("resp_1"), lambda: client.responses.input_items.list("resp_1")):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert "keeps no responses" in caught.value.body["message"]


@pytest.mark.network  # the default model
def test_the_real_engine_answers_a_response_as_it_answers_the_chat():
    from openai_support import served_openai

    with served_openai() as (_, client, _url):
        args = dict(model="SmolLM2-135M-Instruct", temperature=0)
        chat = client.chat.completions.create(messages=[{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "Capital of France?"}],
                                              max_tokens=12, **args)
        response = client.responses.create(instructions="Be brief.", input="Capital of France?",
                                           max_output_tokens=12, **args)
        assert response.output_text == chat.choices[0].message.content
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        with client.responses.stream(instructions="Be brief.", input="Capital of France?", max_output_tokens=12,
                                     **args) as stream:
            assert stream.get_final_response().output_text == response.output_text
