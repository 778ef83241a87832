"""Lists of prompts, token-id prompts, logit_bias, system_fingerprint, x-request-id and the prefix
cache's share of usage through the official openai client, on the real engine (CPU)."""

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from openai_support import served_openai  # noqa: E402

pytestmark = pytest.mark.network  # the default model
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "One, two, three,", "Water boils at"]


@pytest.fixture(scope="module")
def served():
    with served_openai() as (replica, client, url):
        client.url = url
        yield replica, client


def test_a_list_of_prompts_and_of_token_id_lists_equals_one_request_each(served):
    replica, client = served
    args = dict(model=MODEL, max_tokens=4, temperature=0)
    singles = [client.completions.create(prompt=p, **args) for p in PROMPTS]
    batch = client.completions.create(prompt=PROMPTS, **args)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    ids = [replica.tokenizer(p)["input_ids"] for p in PROMPTS]
    by_ids = client.completions.create(prompt=ids, **args)
    assert [c.text for c in by_ids.choices] == [c.text for c in batch.choices]
    one_by_ids = client.completions.create(prompt=ids[1], **args)
    assert one_by_ids.choices[0].text == batch.choices[1].text
    streamed = {}
    for chunk in client.completions.create(prompt=PROMPTS, stream=True, stream_options={"include_usage": True},
                                           **args):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == batch.usage.completion_tokens
    assert [streamed[i] for i in range(3)] == [c.text for c in batch.choices]


def test_a_refused_prompt_among_good_ones_stops_them_and_closes_every_stream(served, caplog):
    """One 400 for the request; the good prompts' generations are cancelled, aborted and closed
    (schemathesis found the siblings still reading their streams when they were closed)."""
    import logging
    import time

    replica, client = served
    with caplog.at_level(logging.WARNING, logger="ponytail.openai"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt=["Once upon a time", ""], max_tokens=400, n=2)
        assert "prompt='' is empty" in str(caught.value)
        deadline = time.monotonic() + 30
        while replica.llm.stats().num_running + replica.llm.stats().num_waiting and time.monotonic() < deadline:
            time.sleep(0.05)
    assert replica.llm.stats().num_running == replica.llm.stats().num_waiting == 0
    assert "failed" not in caplog.text


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(served):
    replica, client = served
    block = replica.info.block_size
    prompt = "Ponytail usage check: " + " ".join(f"item{i}" for i in range(40))  # several blocks, seen by no other test
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0).usage
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0).usage
    assert first.prompt_tokens > 2 * block and first.prompt_tokens_details.cached_tokens == 0
    # whole blocks of the prompt, less its last token, which the engine always computes
    assert again.prompt_tokens_details.cached_tokens == (again.prompt_tokens - 1) // block * block
    chat = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2)
    streamed = [c.usage for c in client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=2, stream=True, stream_options={"include_usage": True}) if c.usage]
    assert streamed[-1].prompt_tokens_details.cached_tokens == (streamed[-1].prompt_tokens - 1) // block * block
    assert streamed[-1].completion_tokens_details is None  # the default model does not reason
    response = client.responses.create(model=MODEL, input=prompt, max_output_tokens=2)
    details = response.usage.input_tokens_details, response.usage.output_tokens_details
    assert details[0].cached_tokens == (response.usage.input_tokens - 1) // block * block > 0
    assert details[1].reasoning_tokens == 0


def test_choices_say_which_stop_string_or_token_ended_them(served):
    replica, client = served
    args = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    free = client.completions.create(**args).choices[0]
    assert free.finish_reason == "length" and free.stop_reason is None
    words = free.text.split()
    assert len(words) > 1, free.text
    by_string = client.completions.create(**args, stop=[words[1]]).choices[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", words[1])  # vLLM's stop_reason
    token = replica.tokenizer(free.text, add_special_tokens=False)["input_ids"][2]
    by_token = client.completions.create(**args, extra_body={"stop_token_ids": [token]}).choices[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", token)
    streamed = [c.choices[0] for c in client.completions.create(**args, stop=[words[1]], stream=True) if c.choices]
    assert (streamed[-1].finish_reason, streamed[-1].stop_reason) == ("stop", words[1])


def test_responses_return_the_answers_logprobs_when_included_as_chat_does(served):
    _, client = served
    ask = dict(model=MODEL, max_output_tokens=6, temperature=0)
    response = client.responses.create(input="Capital of France?", include=["message.output_text.logprobs"],
                                       top_logprobs=2, **ask)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capital of France?"}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    part = response.output[0].content[0]
    assert part.text == chat.choices[0].message.content
    # Same tokens and alternatives; the values within float noise (a repeated prompt reads cached blocks)
    expected = chat.choices[0].logprobs.content
    assert [(t.token, [a.token for a in t.top_logprobs]) for t in part.logprobs] == [
        (t.token, [a.token for a in t.top_logprobs]) for t in expected]
    assert len(part.logprobs) == 6 and all(len(t.top_logprobs) == 2 for t in part.logprobs)
    assert [t.logprob for t in part.logprobs] == pytest.approx([t.logprob for t in expected], abs=1e-4)
    with client.responses.stream(input="Capital of France?", include=["message.output_text.logprobs"],
                                 top_logprobs=2, **ask) as stream:
        events = list(stream)
    deltas = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert events[-1].type == "response.incomplete"  # max_output_tokens cut it, as the whole one
    final = events[-1].response.output[0].content[0]
    assert [t.token for t in deltas] == [t.token for t in final.logprobs] == [t.token for t in expected]
    assert [t.logprob for t in deltas] == [t.logprob for t in final.logprobs]
    plain = client.responses.create(input="Capital of France?", top_logprobs=2, **ask)  # not included: none
    assert plain.output[0].content[0].logprobs == []


def test_tokenize_counts_a_conversation_with_earlier_tool_calls_as_the_chat_runs_it(served):
    """The template is handed earlier calls the way a chat hands them (here, with no tool format,
    described as the assistant's content), so /tokenize and the chat's prompt_tokens agree."""
    import json
    import urllib.request

    _, client = served
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=[weather], tool_choice="none",
                                          max_tokens=1)
    request = urllib.request.Request(client.url + "/tokenize", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"messages": messages, "tools": [weather]}).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.loads(response.read())["count"] == chat.usage.prompt_tokens


def test_logit_bias_steers_the_tokens(served):
    replica, client = served
    args = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    plain = client.completions.create(**args)
    first = replica.tokenizer(plain.choices[0].text)["input_ids"][0]
    banned = client.completions.create(**args, logit_bias={str(first): -100})
    assert replica.tokenizer(banned.choices[0].text)["input_ids"][0] != first
    forced = replica.tokenizer(" banana")["input_ids"][0]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == " banana" * 3
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(**args, logit_bias={"x": 1})


def test_system_fingerprint_and_one_request_id_header(served):
    _, client = served
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2)
    out = raw.parse()
    assert out.system_fingerprint.startswith("fp_")
    assert len(raw.headers.get_list("x-request-id")) == 1 and raw.headers["x-request-id"] in out.id
    chat = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_headers={"X-Request-Id": "abc"})
    assert chat.headers.get_list("x-request-id") == ["abc"]
    assert chat.parse().id == "chatcmpl-abc" and chat.parse().system_fingerprint == out.system_fingerprint
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=2, stream=True))
    assert {c.system_fingerprint for c in chunks} == {out.system_fingerprint}


def test_tokenize_detokenize_version_and_the_models_root(served):
    import json
    import urllib.error
    import urllib.request

    import ponytail
    from transformers import AutoTokenizer

    replica, client = served

    def call(path, body=None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(client.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    ids = replica.tokenizer(PROMPTS[0])["input_ids"]
    assert call("/tokenize", {"prompt": PROMPTS[0]}) == (200, {"tokens": ids, "count": len(ids),
                                                               "max_model_len": 1024})
    status, chat = call("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and chat["count"] > 3
    assert call("/detokenize", {"tokens": ids}) == (200, {"prompt": PROMPTS[0]})
    status, error = call("/detokenize", {"tokens": [10**9]})
    assert status == 400 and error["error"]["param"] == "tokens" and "outside the vocabulary" in error["error"]["message"]
    status, error = call("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert status == 400 and "exactly one of prompt" in error["error"]["message"]
    status, error = call("/tokenize", {"messages": []})  # a 500 from the chat template before (schemathesis)
    assert (status, error["error"]["param"]) == (400, "messages")
    assert error["error"]["message"] == "messages: List should have at least 1 item after validation, not 0 (got [])"
    assert call("/version") == (200, {"version": ponytail.__version__})
    model, alias = client.models.list().data
    assert model.id == model.root and alias.id == MODEL  # served where its tokenizer loads from; the short name too
    # What clients such as guidellm do with it: load the tokenizer by the first model's id, and it is the engine's.
    tokenizer = AutoTokenizer.from_pretrained(model.id)
    assert tokenizer(PROMPTS[0])["input_ids"] == ids


def test_metrics_on_the_api_port_in_prometheus_text(served):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    _, client = served
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0,
                              extra_body={"ignore_eos": True})
    with urllib.request.urlopen(client.url + "/metrics", timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {(s.name, s.labels.get("finished_reason")): s for f in text_string_to_metric_families(text)
               for s in f.samples}
    for name in ("ponytail:prompt_tokens_total", "ponytail:generation_tokens_total",
                 "ponytail:time_to_first_token_seconds_count", "ponytail:e2e_request_latency_seconds_count",
                 "ponytail:kv_cache_usage_perc", "ponytail:num_requests_running", "ponytail:num_requests_waiting",
                 "ponytail:num_preemptions_total", "ponytail:prefix_cache_queries_total"):
        assert samples[(name, None)].labels["model_name"] == MODEL, name
    assert samples[("ponytail:generation_tokens_total", None)].value >= 2
    assert samples[("ponytail:request_success_total", "length")].value >= 1
    assert samples[("ponytail:prefix_cache_queries_total", None)].value > 0
