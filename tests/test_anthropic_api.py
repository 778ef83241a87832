"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`; deployments/anthropic_protocol.py
and anthropic_api.py) through the official `anthropic` client: over backends that write a script
(text, tool calls, a thought, failures), then on the real engine (CPU)."""

import json

import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from deployments.api.http_guard import AccessPolicy  # noqa: E402
from deployments.app.local_server import serve_on_loopback  # noqa: E402
from deployments.api.server import build_app  # noqa: E402
from test_reasoning import THOUGHT, ReasoningBackend  # noqa: E402
from test_tool_choice_auto import MODEL, ScriptedBackend  # noqa: E402
from request_fields import sampling_set  # noqa: E402

ASK = [{"role": "user", "content": "Capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = ['I will check.', '<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool_call>']


class StoppingBackend(ScriptedBackend):
    """The script's deltas; the last one says which stop string ended it (`stop_reason`)."""

    stop_reason = None

    async def _deltas(self, request):
        async for delta in super()._deltas(request):
            if delta.finished:
                delta.stop_reason = self.stop_reason
            yield delta


@pytest.fixture(scope="module")
def served():
    backend = StoppingBackend()
    with serve_on_loopback(build_app(backend)) as url:
        with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=5.0) as client:
            yield backend, client


def _streamed(client, **kwargs):
    with client.messages.stream(model=MODEL, **kwargs) as stream:
        events = [event.type for event in stream]
        return events, stream.get_final_message()


def test_a_message_whole_and_streamed(served):
    backend, client = served
    backend.script, backend.stop_reason = ["Paris", " is the capital", "."], None
    message = client.messages.create(model=MODEL, max_tokens=64, messages=ASK, system="Be brief.")
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == MODEL
    assert [(b.type, b.text) for b in message.content] == [("text", "Paris is the capital.")]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens, message.usage.output_tokens) == (10, 0, 3)
    request = backend.requests[-1]
    assert request.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    assert sampling_set(request)["max_tokens"] == 64

    events, final = _streamed(client, max_tokens=64, messages=ASK, system=[{"type": "text", "text": "Be brief."}])
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert events.count("content_block_start") == events.count("content_block_stop") == 1
    assert final.content[0].text == "Paris is the capital." and final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (10, 3)
    assert backend.requests[-1].messages == request.messages  # system as blocks reads as the string


def test_stop_reasons_max_tokens_and_the_stop_sequence_that_matched(served):
    backend, client = served
    backend.script, backend.stop_reason = ["Paris"], "\n\n"
    message = client.messages.create(model=MODEL, max_tokens=64, messages=ASK, stop_sequences=["\n\n", "END"])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "\n\n")
    assert sampling_set(backend.requests[-1])["stop"] == ["\n\n", "END"]
    assert _streamed(client, max_tokens=64, messages=ASK, stop_sequences=["\n\n"])[1].stop_sequence == "\n\n"
    backend.stop_reason = 7  # a stop token id: not one of the request's sequences
    assert client.messages.create(model=MODEL, max_tokens=64, messages=ASK).stop_reason == "end_turn"


def test_a_tool_call_comes_back_as_a_tool_use_block_whole_and_streamed(served):
    backend, client = served
    backend.script, backend.stop_reason = CALL, None
    message = client.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=[WEATHER])
    assert message.stop_reason == "tool_use"
    text, call = message.content
    assert text.text == "I will check." and (call.type, call.name, call.input) == ("tool_use", "get_weather",
                                                                                   {"city": "Paris"})
    tool = backend.requests[-1].tools[0]["function"]
    assert tool["name"] == "get_weather" and tool["parameters"] == WEATHER["input_schema"]
    events, final = _streamed(client, max_tokens=64, messages=ASK, tools=[WEATHER])
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use" and "input_json" in events

    client.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=[WEATHER],
                           tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert "structured_outputs" in sampling_set(backend.requests[-1])  # a named call is grammar-bound
    client.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"})
    assert "structured_outputs" in sampling_set(backend.requests[-1])  # any: OpenAI's required
    backend.script = ["Fine."]
    message = client.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=[WEATHER],
                                     tool_choice={"type": "none"})
    assert message.content[0].text == "Fine." and "structured_outputs" not in sampling_set(backend.requests[-1])


def test_a_conversation_with_tool_use_and_results_reaches_the_template_as_chat_messages(served):
    backend, client = served
    backend.script = ["It is sunny."]
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": [
                 {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                 {"type": "text", "text": "Checking."},
                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}],
                  "cache_control": {"type": "ephemeral"}},
                 {"type": "text", "text": "And so?"}]}]
    client.messages.create(model=MODEL, max_tokens=64, messages=turns, tools=[WEATHER])
    assert backend.requests[-1].messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},  # as templates read
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And so?"}]
    failed = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "timeout",
                                            "is_error": True}]}]
    client.messages.create(model=MODEL, max_tokens=64, messages=turns[:2] + failed, tools=[WEATHER])
    assert backend.requests[-1].messages[-1] == {"role": "tool", "content": "Error: timeout", "tool_call_id": "toolu_1"}


@pytest.mark.parametrize("body, status, kind, message", [
    ({"messages": ASK}, 400, "invalid_request_error", "max_tokens: Field required"),
    ({"max_tokens": 0, "messages": ASK}, 400, "invalid_request_error", "max_tokens=0 is invalid; allowed: at least 1"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "messages[0].content[0].type='image' is not supported in a user turn; allowed: text"),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error",
     "messages[0].role='system' is invalid; allowed: user, assistant (the system prompt goes in system)"),
    ({"max_tokens": 8, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "tools[0].type='web_search_20250305' is not supported; allowed: custom tools"),
    ({"max_tokens": 8, "messages": ASK, "tool_choice": {"type": "tool"}}, 400, "invalid_request_error",
     'tool_choice={"type": "tool"} is invalid; allowed: type auto, any, none, or tool with a name'),
    ({"max_tokens": 8, "messages": ASK, "thinking": {"type": "on"}}, 400, "invalid_request_error",
     "thinking.type='on' is invalid; allowed: enabled, disabled, adaptive"),
    ({"max_tokens": 64, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 64}}, 400,
     "invalid_request_error", "thinking.budget_tokens=64 is invalid; allowed: an integer from 1 to max_tokens - 1 (63)"),
    ({"max_tokens": 64, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": "8"}}, 400,
     "invalid_request_error", "thinking.budget_tokens='8' is invalid; allowed: an integer from 1 to max_tokens - 1"),
    ({"max_tokens": 8, "messages": ASK, "mcp_servers": [{"url": "x"}]}, 400, "invalid_request_error",
     "mcp_servers=[{'url': 'x'}] is not supported"),
    ({"max_tokens": 8, "messages": ASK, "model": "claude-sonnet"}, 404, "not_found_error",
     "the model 'claude-sonnet' does not exist; this server serves 'hermes-model'"),
])
def test_bad_requests_get_anthropics_error_shape_naming_the_field(served, body, status, kind, message):
    _, client = served
    with pytest.raises(anthropic.APIStatusError) as raised:
        client.post("/v1/messages", cast_to=object, body={"model": MODEL, **body})
    error = raised.value
    assert error.status_code == status and error.body["type"] == "error"
    assert error.body["error"]["type"] == kind and error.body["error"]["message"].startswith(message)


def test_sampling_fields_output_config_and_thinking_reach_the_chat_request(served):
    backend, client = served
    backend.script = ['{"city": "Paris"}']
    # temperature, top_p and top_k: Anthropic's fields, which the newest SDKs no longer list
    client.messages.create(model=MODEL, max_tokens=32, messages=ASK, cache_control={"type": "ephemeral"},
                           output_config={"format": {"type": "json_schema", "schema": WEATHER["input_schema"]},
                                          "effort": "low"},
                           thinking={"type": "disabled"},
                           extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.1})
    request = backend.requests[-1]
    assert {k: sampling_set(request)[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty")} == {
        "temperature": 0.5, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.1}
    assert sampling_set(request)["structured_outputs"]["json"] == WEATHER["input_schema"]
    assert request.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    client.messages.create(model=MODEL, max_tokens=32, messages=ASK, thinking={"type": "enabled", "budget_tokens": 16},
                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert backend.requests[-1].chat_template_kwargs == {"enable_thinking": False}  # the request's own kwargs win
    assert "thinking_token_budget" not in sampling_set(backend.requests[-1])  # a model that does not think: no budget


def test_budget_tokens_bounds_a_reasoning_models_thought():
    """thinking.budget_tokens reaches the engine as vLLM's thinking_token_budget where the model thinks
    in tags; the engine then writes </think> once the thought has used it (tests of sampling/thinking.py)."""
    backend = ReasoningBackend()
    backend.script = THOUGHT
    with serve_on_loopback(build_app(backend)) as url:
        with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=5.0) as client:
            client.messages.create(model=MODEL, max_tokens=256, messages=ASK,
                                   thinking={"type": "enabled", "budget_tokens": 128})
            budgeted = backend.requests[-1]
            client.messages.create(model=MODEL, max_tokens=256, messages=ASK, thinking={"type": "adaptive"})
            adaptive = backend.requests[-1]
    assert sampling_set(budgeted)["thinking_token_budget"] == 128 and budgeted.chat_template_kwargs == {
        "enable_thinking": True}
    assert "thinking_token_budget" not in sampling_set(adaptive)


def test_a_thought_comes_back_as_a_thinking_block_whole_and_streamed():
    backend = ReasoningBackend()
    backend.script = THOUGHT
    with serve_on_loopback(build_app(backend)) as url:
        with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=5.0) as client:
            message = client.messages.create(model=MODEL, max_tokens=64, messages=ASK)
            events, final = _streamed(client, max_tokens=64, messages=ASK)
            plain = client.messages.create(model=MODEL, max_tokens=64, messages=ASK, thinking={"type": "disabled"})
    for answer in (message, final):
        thought, text = answer.content
        assert (thought.type, thought.thinking, text.text) == ("thinking", "The user asks for France's capital.",
                                                               "Paris.")
    assert "thinking" in events and events.count("content_block_start") == 2
    assert plain.content[0].type == "text"  # enable_thinking false: no split (Qwen3's rule)


def test_an_engine_failure_mid_stream_is_an_error_event_and_an_api_key_may_come_as_x_api_key():
    from test_openai_api import FakeBackend, MODEL as FAKE

    backend = FakeBackend()
    backend.fail, backend.fail_at = RuntimeError("boom"), "later"
    with serve_on_loopback(build_app(backend, policy=AccessPolicy(api_key="sk-local"))) as url:
        with anthropic.Anthropic(base_url=url, api_key="sk-local", max_retries=0, timeout=5.0) as client:
            with pytest.raises(anthropic.APIStatusError, match="internal server error in request"):
                with client.messages.stream(model=FAKE, max_tokens=8, messages=ASK) as stream:
                    list(stream)
        with anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0, timeout=5.0) as client:
            with pytest.raises(anthropic.AuthenticationError) as raised:
                client.messages.create(model=FAKE, max_tokens=8, messages=ASK)
        assert raised.value.body["error"]["type"] == "authentication_error"
        with anthropic.Anthropic(base_url=url, auth_token="sk-local", max_retries=0, timeout=5.0) as client:
            backend.fail = None
            assert client.messages.create(model=FAKE, max_tokens=3, messages=ASK).usage.output_tokens == 3


@pytest.mark.network  # the default model
def test_on_the_real_engine_counts_the_prefix_cache_and_count_tokens_matches():
    from deployments.app.local_server import local_server

    with local_server() as (replica, url):
        with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120) as client:
            model = replica.info.model_id
            turns = [{"role": "user", "content": "List the planets: " + ", ".join(f"p{i}" for i in range(40))}]
            counted = client.messages.count_tokens(model=model, messages=turns, system="Be brief.").input_tokens
            ask = dict(model=model, max_tokens=8, messages=turns, system="Be brief.", extra_body={"temperature": 0})
            first = client.messages.create(**ask)
            again = client.messages.create(**ask)
            words = first.content[0].text.split()
            assert len(words) > 1, first.content[0].text  # a second word to stop at
            stopped = client.messages.create(**ask, stop_sequences=[words[1]])
    block = replica.info.block_size
    assert counted == first.usage.input_tokens + first.usage.cache_read_input_tokens > 2 * block
    assert again.usage.cache_read_input_tokens == (counted - 1) // block * block  # all but the last token's block
    assert again.usage.input_tokens == counted - again.usage.cache_read_input_tokens
    assert again.content[0].text == first.content[0].text  # greedy: the cached blocks give the same answer
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", words[1])


@pytest.mark.parametrize("body, status, kind, message", [
    (b"{bad", 400, "invalid_request_error", "the body is not valid JSON: Expecting property name"),
    (b'{"model": "claude-sonnet", "messages": []}', 404, "not_found_error",
     "the model 'claude-sonnet' does not exist; this server serves 'hermes-model'"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "document"}]}]}).encode(), 400,
     "invalid_request_error", "messages[0].content[0].type='document' is not supported in a user turn"),
    (json.dumps({"model": MODEL}).encode(), 400, "invalid_request_error", "messages: Field required"),
    (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "invalid_request_error",  # not the template's 500
     "messages: List should have at least 1 item after validation, not 0"),
])
def test_count_tokens_refuses_bad_requests_in_anthropics_shape(served, body, status, kind, message):
    try:
        import httpx2 as httpx  # what openai>=3 ships with
    except ImportError:  # pragma: no cover - older clients use httpx
        import httpx

    _, client = served
    response = httpx.post(f"{client.base_url}/v1/messages/count_tokens".replace("//v1", "/v1"), content=body,
                          headers={"Content-Type": "application/json"}, timeout=5.0)
    assert response.status_code == status
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert error["error"]["message"].startswith(message), error
