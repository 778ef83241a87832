"""Structured outputs and tool calls through the official openai client, on the CPU.

The real chat path without Ray: build_app over deployments.app.replica.EngineReplica's generate (chat
template, tools) driving an AsyncLLM of the default model, served by uvicorn on 127.0.0.1.
"""

import copy
import dataclasses
import json
import socket
import threading
import time
from enum import Enum

import pytest

pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
jsonschema = pytest.importorskip("jsonschema")
from pydantic import BaseModel, Field  # noqa: E402

import ponytail  # noqa: E402
from deployments.app.local_server import serve_on_loopback  # noqa: E402
from deployments.api.server import build_app  # noqa: E402
from deployments.api.engine_requests import to_draft  # noqa: E402
from deployments.api.openai_requests import ChatCompletionRequest  # noqa: E402
from deployments.api.prompt_bounds import PromptBounds  # noqa: E402
from deployments.api.prompts import chat_token_ids  # noqa: E402
from deployments.api.tool_parsers import HERMES, MISTRAL, tool_call_format  # noqa: E402
from deployments.api.tools import plan_structured  # noqa: E402
from deployments.api.protocol import ModelInfo  # noqa: E402
from ponytail import TokenTexts  # noqa: E402
from deployments.app.replica import EngineReplica  # noqa: E402
from deployments.api.segment_tokens import SegmentCache  # noqa: E402

pytestmark = pytest.mark.network  # the default model
MODEL = "SmolLM2-135M-Instruct"
WAIT_S = 120.0  # CPU generation on a shared machine

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "kind": {"type": "string", "enum": ["cat", "dog", "bird"]},
        "owner": {"type": "object", "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "verified": {"type": "boolean"}}, "required": ["age", "verified"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "owner", "tags"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class _NoMetrics:
    def on_finished(self, output):
        pass


class LocalReplica(EngineReplica):
    """EngineReplica's request path (chat template, tools, deltas) without Ray or its metrics."""

    def __init__(self, llm):
        self.llm, self.async_llm, self.tokenizer = llm, ponytail.AsyncLLM(llm), llm.tokenizer
        self.token_texts = TokenTexts(self.tokenizer)
        self.metrics, self.num_requests = _NoMetrics(), 0
        self.admit_seconds, self.ttft_seconds, self.queue_seconds, self.num_ttft = 0.0, 0.0, 0.0, 0
        self._fingerprint = None  # no router in front: nothing comes tokenized
        self.segments = SegmentCache(self.tokenizer)
        self.info = ModelInfo(model_id=MODEL, max_model_len=llm.engine.scheduler.max_model_len,
                              block_size=16, device="cpu", device_uuid=None)
        self.template_defaults = None
        self.bounds = PromptBounds.of(self.tokenizer, self.info.max_model_len, None)

    def stream(self, request):
        return self.generate(request)


@pytest.fixture(scope="module")
def replica(default_model):
    model, tokenizer = default_model
    return LocalReplica(ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="64MiB", max_num_seqs=16,
                                     max_model_len=1024))


@pytest.fixture(scope="module")
def client(replica):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(build_app(replica), log_level="warning", lifespan="off",
                                       timeout_graceful_shutdown=1))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=WAIT_S) as c:
        yield c
    uv.should_exit = True
    thread.join(timeout=10)
    sock.close()


class Kind(str, Enum):
    cat = "cat"
    dog = "dog"


class Owner(BaseModel):
    age: int = Field(ge=0, le=120)
    verified: bool


class Pet(BaseModel):
    name: str = Field(max_length=20)
    kind: Kind
    owner: Owner
    tags: list[Kind] = Field(max_length=2)


def test_parse_returns_a_valid_pydantic_instance(client):
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "Describe a pet."}], response_format=Pet,
            max_tokens=120, temperature=1.0, seed=seed)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Pet)
        assert Pet.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_schema_validates_over_many_seeded_samples_at_temperature_1(client):
    outputs = set()
    for seed in range(12):
        completion = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Give me a pet as JSON."}], temperature=1.0,
            seed=seed, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": NESTED}})
        text = completion.choices[0].message.content
        assert completion.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), NESTED)
        outputs.add(text)
    assert len(outputs) > 3  # sampled, not one fixed answer


def test_json_object_gives_an_object(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A JSON object about Paris."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].message.content), dict)


def test_named_tool_call_has_arguments_matching_the_schema(client):
    for seed in range(3):
        completion = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=1.0, seed=seed, max_tokens=80,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_call_names_a_tool_and_validates(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(3):
        completion = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0,
            seed=seed, max_tokens=150, parallel_tool_calls=False)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        (call,) = choice.message.tool_calls  # parallel_tool_calls=False: exactly one
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_streamed_tool_call_matches_the_whole_answer(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=80,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert len(deltas) > 2  # the arguments come in pieces
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                  max_tokens=150)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    required = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    deltas = [d for c in required for d in (c.choices[0].delta.tool_calls or [])]
    firsts = [d for d in deltas if d.id]  # each call opens with its id and name, then its arguments in pieces
    assert [(d.index, d.function.name) for d in firsts] == [(i, call.function.name) for i, call in enumerate(whole)]
    assert len(deltas) > 2 * len(firsts)
    for i, call in enumerate(whole):
        assert "".join(d.function.arguments or "" for d in deltas if d.index == i) == call.function.arguments
    assert required[-1].choices[0].finish_reason == "tool_calls"


def test_a_forced_call_cut_short_finishes_length_and_is_never_text(client):
    """max_tokens ends the call before its JSON closes: finish_reason "length", no content, only the
    calls that were whole (none here); the stream has sent the pieces it had, then the same finish."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0,
                      max_tokens=6)
        cut = client.chat.completions.create(**kwargs).choices[0]
        assert (cut.finish_reason, cut.message.content, cut.message.tool_calls) == ("length", None, None)
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        assert not any(c.choices[0].delta.content for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"


def test_streamed_json_schema_matches_the_whole_answer(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "A pet as JSON."}], temperature=0,
                  max_tokens=120, response_format={"type": "json_schema",
                                                   "json_schema": {"name": "pet", "schema": NESTED}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), NESTED)


def test_tool_results_go_through_the_chat_template(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    completion = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                                temperature=0, max_tokens=30)
    assert completion.choices[0].message.content
    assert completion.usage.prompt_tokens > 60  # the call and its result are in the prompt


def test_vllm_constraints_bind_chat_and_completions(client):
    """structured_outputs (vLLM's field: choice, regex, grammar, json), its older guided_* names,
    and response_format on completions, through the openai SDK's extra_body."""
    import re

    cities = ["Paris", "Rome", "Madrid"]
    for extra in ({"structured_outputs": {"choice": cities}}, {"guided_choice": cities}):
        for seed in range(3):
            chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=1.0,
                                                  seed=seed, extra_body=extra)
            assert chat.choices[0].message.content in cities and chat.choices[0].finish_reason == "stop"
    text = client.completions.create(model=MODEL, prompt="A code:", max_tokens=12, temperature=1.0, seed=1,
                                     extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-[0-9]{2}"}}).choices[0].text
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", text), text
    grammar = 'root ::= "yes" | "no"'
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=4, stream=True, extra_body={"guided_grammar": grammar}) if c.choices)
    assert streamed in ("yes", "no")
    pet = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
           "additionalProperties": False}
    whole = client.completions.create(model=MODEL, prompt="A pet as JSON:", max_tokens=60, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": pet}}})
    assert set(json.loads(whole.choices[0].text)) == {"name"}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={
            "response_format": {"type": "json_object"}, "guided_choice": ["a"]})
    assert caught.value.body["param"] == "guided_choice" and "cannot be combined with response_format" in \
        caught.value.body["message"]


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(tools=[WEATHER]), "tool_choice", "'auto'"),
    (dict(tools=[WEATHER], tool_choice="auto"), "tool_choice", "not supported"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "names no tool"),
    (dict(tool_choice="required"), "tool_choice", "without tools"),
    (dict(tools=[WEATHER, WEATHER], tool_choice="required"), "tools", "twice"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format", "schema"),
    (dict(response_format={"type": "json_object"}, tools=[WEATHER], tool_choice="required"), "response_format",
     "cannot be combined"),
    (dict(extra_body={"guided_decoding_backend": "outlines"}), "guided_decoding_backend", "not supported"),
    (dict(extra_body={"structured_outputs": {"choice": ["a"]}, "guided_regex": "a"}), "structured_outputs",
     "cannot be combined with guided_regex"),
    (dict(extra_body={"structured_outputs": {"choice": ["a"]}}, response_format={"type": "json_object"}),
     "structured_outputs", "cannot be combined with response_format"),
    (dict(extra_body={"structured_outputs": {"choice": ["a"]}}, tools=[WEATHER], tool_choice="required"),
     "structured_outputs", "cannot be combined with tool_choice='required'"),
    (dict(extra_body={"structured_outputs": {"regex": "[a-"}}), "structured_outputs", "cannot be compiled"),
    (dict(extra_body={"structured_outputs": {"choice": []}}), "structured_outputs", "non-empty list"),
    (dict(extra_body={"structured_outputs": {"whitespace_pattern": " "}}), "structured_outputs",
     "unsupported field(s) ['whitespace_pattern']"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     "response_format", "cannot be compiled"),
])
def test_unsupported_or_bad_requests_are_400s_naming_the_field(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **kwargs)
    error = caught.value.body
    assert error["param"] == param, error
    assert words in error["message"], error


# A chat template that writes tool calls as Hermes's do (Qwen2.5's kind), for SmolLM2's tokens.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You can call these functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}To call one, write <tool_call>
{"name": <its name>, "arguments": <an object>}
</tool_call><|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.content %}{{ m.content }}{% endif %}{% for c in m.tool_calls or [] %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def hermes_tokenizer(replica):
    tokenizer = copy.deepcopy(replica.tokenizer)
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def hermes_client(replica, hermes_tokenizer):
    """The same engine behind a replica whose template writes Hermes tool calls (found, as
    EngineReplica finds it, from the template)."""
    hermes = copy.copy(replica)
    hermes.tokenizer, hermes.segments = hermes_tokenizer, SegmentCache(hermes_tokenizer)
    hermes.info = dataclasses.replace(replica.info, tool_call_format=tool_call_format(hermes_tokenizer.chat_template))
    assert hermes.info.tool_call_format == HERMES and tool_call_format(replica.tokenizer.chat_template) is None
    with serve_on_loopback(build_app(hermes)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=WAIT_S) as c:
            yield c


def test_auto_runs_the_model_freely_and_agrees_streamed(hermes_client):
    """tool_choice unset (auto): the tools go into the prompt, the model writes what it writes
    (SmolLM2 does not call tools: text here), and the stream says the same as the whole answer."""
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=24)
    whole = hermes_client.chat.completions.create(**kwargs)
    without_tools = hermes_client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=1)
    assert whole.usage.prompt_tokens > without_tools.usage.prompt_tokens + 40  # the tool list is in the prompt
    chunks = [c for c in hermes_client.chat.completions.create(stream=True, **kwargs) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks) or None
    calls = [(d.function.name, d.function.arguments) for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    choice = whole.choices[0]
    assert content == choice.message.content
    assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert choice.finish_reason in (("tool_calls",) if calls else ("stop", "length"))


def test_earlier_calls_render_as_objects_in_a_tool_format_template(hermes_tokenizer):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    req = ChatCompletionRequest(model=MODEL, messages=messages, tools=[WEATHER])
    draft = to_draft(req, "r")
    plan_structured(req, draft, HERMES)
    generate = draft.request
    text = hermes_tokenizer.decode(chat_token_ids(hermes_tokenizer, generate.messages, generate.tools))
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text  # not quoted twice
    assert text.count("get_weather") == 2  # in the tool list and in the call


# Like Mistral-7B-Instruct-v0.3's template where it matters here: calls after [TOOL_CALLS], and any
# call id but 9 characters raised as an error.
MISTRAL_TEMPLATE = """{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }}[/INST]
{%- elif m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}{% if c.id | length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}
{{- '{"name": "' + c.function.name + '", "arguments": ' + c.function.arguments | tojson + ', "id": "' + c.id + '"}' }}
{%- endfor %}]</s>{% elif m.role == 'tool' %}{% if m.tool_call_id | length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}
{{- '[TOOL_RESULTS] {"content": ' + m.content | tojson + ', "call_id": "' + m.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- else %}{{ m.content }}</s>{% endif %}{% endfor %}"""


def test_earlier_calls_with_long_ids_render_in_a_mistral_template(replica):
    tokenizer = copy.deepcopy(replica.tokenizer)
    tokenizer.chat_template = MISTRAL_TEMPLATE
    assert tool_call_format(tokenizer.chat_template) == MISTRAL
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9f8e7d6c5b4a", "type": "function",
                                                               "function": {"name": "get_weather",
                                                                            "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9f8e7d6c5b4a", "content": "18 degrees"}]
    req = ChatCompletionRequest(model=MODEL, messages=messages, tools=[WEATHER])
    with pytest.raises(ponytail.ConfigError, match="messages: the chat template refused them: .*length 9"):
        # the client's ids as they came: a 400 naming messages
        chat_token_ids(tokenizer, to_draft(req, "r").request.messages)
    draft = to_draft(req, "r")
    plan_structured(req, draft, MISTRAL)
    generate = draft.request
    text = tokenizer.decode(chat_token_ids(tokenizer, generate.messages, generate.tools))
    call_id = generate.messages[1]["tool_calls"][0]["id"]
    assert len(call_id) == 9 and f'"id": "{call_id}"' in text and f'"call_id": "{call_id}"' in text
    assert '"arguments": {"city": "Paris"}' in text  # an object, not quoted twice
