"""A reasoning model's thought split from its answer (deployments/reasoning.py, vLLM's
--reasoning-parser): the format found from the template, the split cut anywhere, and the API's
`reasoning` field through the official openai client over a backend that writes a script."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.api.reasoning import (DEEPSEEK_R1, QWEN3, THINK, ReasoningTokens, ThoughtStream, reasoning_format,
                                       served_reasoning_format, split_reasoning, starts_in_thought, thought_opens)

QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
                  "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
R1_TEMPLATE = ("{% for m in messages %}{{ m.content.split('</think>')[-1] }}{% endfor %}"
               "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}")


def test_the_format_is_found_from_the_template_or_set_by_the_operator():
    assert reasoning_format(QWEN3_TEMPLATE) == reasoning_format(R1_TEMPLATE) == THINK
    assert reasoning_format({"default": "{{ messages }}", "tool_use": QWEN3_TEMPLATE}) == THINK
    assert reasoning_format("{{ messages }}") is None and reasoning_format(None) is None
    assert served_reasoning_format("auto", R1_TEMPLATE) == THINK
    assert served_reasoning_format(DEEPSEEK_R1, "{{ messages }}") == DEEPSEEK_R1
    assert served_reasoning_format("none", QWEN3_TEMPLATE) is None  # the thought stays in the content
    assert served_reasoning_format(QWEN3, "{{ messages }}") == QWEN3  # forced, whatever the template
    with pytest.raises(ValueError, match="reasoning_parser='o1' is not supported; allowed: auto, deepseek_r1, "
                                         "qwen3, none"):
        served_reasoning_format("o1", None)


def test_where_the_answer_starts():
    # vLLM's rules, set by the operator
    assert starts_in_thought(QWEN3, None) and starts_in_thought(QWEN3, {"enable_thinking": True})
    assert not starts_in_thought(QWEN3, {"enable_thinking": False})
    assert starts_in_thought(DEEPSEEK_R1, {"enable_thinking": False})  # R1's template always opens the thought
    # auto: from what the generation prompt opens (enable_thinking unset, true, false)
    qwen3x = (True, True, False)
    assert starts_in_thought(THINK, None, qwen3x) and starts_in_thought(THINK, {"enable_thinking": True}, qwen3x)
    assert starts_in_thought(THINK, {"enable_thinking": False}, qwen3x) is None  # a thought only if it opens one
    assert starts_in_thought(THINK, None, (False, False, False)) is None


@pytest.mark.parametrize("text, thinking, expected", [
    ("<think>\nI recall it.\n</think>\n\nParis.", True, ("I recall it.", "Paris.")),  # Qwen3 writes the tag
    ("I recall it.\n</think>\n\nParis.", True, ("I recall it.", "Paris.")),  # R1: the prompt opened it
    ("Still thinking when max_tokens hit", True, ("Still thinking when max_tokens hit", "")),
    ("Paris.", False, (None, "Paris.")),  # enable_thinking false: the answer as written
    ("a</think>b</think>c", True, ("a", "bc")),  # a stray close after the thought is dropped
    ("Check.\n<tool_call>\n{}\n</tool_call>", True, ("Check.", "<tool_call>\n{}\n</tool_call>")),
    ("<think>a <think> b</think>c", True, ("a  b", "c")),
    ("\n\n", True, (None, "")),
    # undecided (the prompt opened no thought): a thought only if the answer opens one
    ("\n<think>\nHm.\n</think>\n\nParis.", None, ("Hm.", "Paris.")),
    ("Paris.", None, (None, "Paris.")),
    (" Paris </think> it is", None, (None, "Paris  it is")),
    ("<thi", None, (None, "<thi")),
    ("<think>cut short", None, ("cut short", "")),
])
def test_whole_answers_split(text, thinking, expected):
    assert split_reasoning(text, thinking) == expected


_PIECES = st.sampled_from(["<think>", "</think>", "<tool_call>", "<", "</", "think", ">", " ", "\n", "a", "b c",
                           "</thi", "nk>", "<tool_", "call>"])


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(_PIECES, max_size=12), thinking=st.sampled_from([True, False, None]), data=st.data())
def test_a_stream_cut_anywhere_says_what_the_whole_answer_says(pieces, thinking, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    stream, events = ThoughtStream(thinking), []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        events += stream.feed(text[start:end])
    events += stream.finish()
    reasoning = "".join(t for kind, t in events if kind == "reasoning") or None
    assert (reasoning, "".join(t for kind, t in events if kind == "content")) == split_reasoning(text, thinking)
    assert all(t for _, t in events)  # no empty events


@pytest.mark.parametrize("tokens, thinking, expected", [
    (["<think>", "\n", "I", " recall", "\n", "</think>", "\n\n", "Paris"], True, 4),  # vLLM's count: 4
    (["<think>", "\n", "I", " recall", "\n", "</think>", "\n\n", "Paris"], None, 4),
    (["\n", "<think>", "I", "</think>", "Paris"], None, 1),  # blanks before the tag: still undecided
    (["I", " recall", "</think>", "Paris", " </think>", "a"], True, 2),  # R1: the prompt opened it
    (["Paris", "."], None, 0), (["Paris", "."], False, 0),
    (["<think>", "a", "b"], None, 2),  # cut short by max_tokens: all thought
    (["a", "<tool_call>", "{}"], True, 1),  # a call ends the thought
    (["a", "</th", "ink>", "b"], True, 2),  # a tag in pieces: all but its last count
])
def test_reasoning_tokens_are_the_thoughts_tokens_less_its_tags(tokens, thinking, expected):
    ids = list(range(len(tokens)))
    whole = ReasoningTokens(thinking, tokens.__getitem__)
    assert whole.feed(ids) == expected
    streamed = ReasoningTokens(thinking, tokens.__getitem__)
    assert [streamed.feed([i]) for i in ids][-1] == expected  # one delta per token, as a replica streams


# ---------------------------------------------------------------------------------------- the API
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from deployments.app.local_server import serve_on_loopback  # noqa: E402
from deployments.api.server import build_app  # noqa: E402
from deployments.api.protocol import ModelInfo  # noqa: E402
from test_tool_choice_auto import MODEL, WEATHER, ScriptedBackend  # noqa: E402
from request_fields import sampling_set  # noqa: E402

ASK = [{"role": "user", "content": "Capital of France?"}]
THOUGHT = ["<think>", "\nThe user asks", " for France's capital.", "\n</th", "ink>\n\n", "Paris", "."]


class ReasoningBackend(ScriptedBackend):
    def __init__(self, reasoning: str | None = QWEN3):
        super().__init__()
        self.reasoning_format = reasoning

    async def model_info(self) -> ModelInfo:
        info = await super().model_info()
        info.reasoning_format = self.reasoning_format
        return info

    async def _deltas(self, request):
        """The script's deltas, with the thought's tokens counted as the replica counts them."""
        script = list(self.script)  # piece i is token 100 + i
        counter = ReasoningTokens(request.starts_in_thought, lambda token: script[token - 100])
        async for delta in super()._deltas(request):
            if request.count_reasoning:
                delta.reasoning_tokens = counter.feed(delta.token_ids)
            yield delta


@pytest.fixture(scope="module")
def served():
    backend = ReasoningBackend()
    with serve_on_loopback(build_app(backend)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=5.0) as client:
            yield backend, client


def _streamed(client, **kwargs) -> tuple[str | None, str | None, list]:
    chunks = [c for c in client.chat.completions.create(model=MODEL, stream=True, **kwargs) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas) or None
    content = "".join(d.content or "" for d in deltas) or None
    return reasoning, content, chunks


def test_the_thought_comes_back_as_reasoning_whole_and_streamed(served):
    backend, client = served
    backend.script = THOUGHT
    message = client.chat.completions.create(model=MODEL, messages=ASK).choices[0].message
    assert (message.reasoning, message.content) == ("The user asks for France's capital.", "Paris.")
    reasoning, content, chunks = _streamed(client, messages=ASK)
    assert (reasoning, content) == ("The user asks for France's capital.", "Paris.")
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert sampling_set(backend.requests[-1])["skip_special_tokens"] is False  # tags some tokenizers mark special stay


def test_usage_counts_the_thoughts_tokens(served):
    backend, client = served
    backend.script = THOUGHT  # the thought: "\nThe user asks", " for France's capital.", "\n</th"
    whole = client.chat.completions.create(model=MODEL, messages=ASK)
    assert whole.usage.completion_tokens_details.reasoning_tokens == 3 and whole.usage.completion_tokens == 7
    assert backend.requests[-1].count_reasoning and backend.requests[-1].starts_in_thought is True
    streamed = [c.usage for c in client.chat.completions.create(
        model=MODEL, messages=ASK, stream=True, stream_options={"include_usage": True}) if c.usage]
    assert streamed[-1].completion_tokens_details.reasoning_tokens == 3
    hidden = client.chat.completions.create(model=MODEL, messages=ASK, extra_body={"include_reasoning": False})
    assert hidden.usage.completion_tokens_details.reasoning_tokens == 3  # not shown, still generated
    response = client.responses.create(model=MODEL, input="Capital of France?")
    assert response.usage.output_tokens_details.reasoning_tokens == 3
    backend.script = ["Paris", "."]
    off = client.chat.completions.create(model=MODEL, messages=ASK,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.completion_tokens_details.reasoning_tokens == 0  # a reasoning model told not to think
    assert backend.requests[-1].starts_in_thought is False


def test_enable_thinking_false_and_reasoning_effort_none_answer_without_a_split(served):
    backend, client = served
    backend.script = ["Paris </think>is it."]
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        message = client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra).choices[0].message
        assert message.content == "Paris is it." and getattr(message, "reasoning", None) is None
        assert backend.requests[-1].chat_template_kwargs["enable_thinking"] is False  # for the template
    assert backend.requests[-1].chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": False}
    client.chat.completions.create(model=MODEL, messages=ASK, extra_body={"reasoning_effort": "high"})
    assert backend.requests[-1].chat_template_kwargs == {"reasoning_effort": "high", "enable_thinking": True}


def test_a_thought_cut_short_is_all_reasoning_and_include_reasoning_false_drops_it(served):
    backend, client = served
    backend.script = ["<think>\nStill", " going"]
    message = client.chat.completions.create(model=MODEL, messages=ASK).choices[0].message
    assert (message.reasoning, message.content) == ("Still going", None)
    backend.script = THOUGHT
    message = client.chat.completions.create(model=MODEL, messages=ASK,
                                             extra_body={"include_reasoning": False}).choices[0].message
    assert (getattr(message, "reasoning", None), message.content) == (None, "Paris.")
    assert _streamed(client, messages=ASK, extra_body={"include_reasoning": False})[:2] == (None, "Paris.")


def test_a_tool_call_after_the_thought_is_read_as_a_call(served):
    backend, client = served
    backend.script = ["<think>\nI need the weather.\n</think>\n\n", "<tool_call>\n",
                      '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>']
    choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning == "I need the weather."
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    reasoning, content, chunks = _streamed(client, messages=ASK, tools=[WEATHER])
    assert (reasoning, content) == ("I need the weather.", None)
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather", None]  # the name, then the arguments as written
    assert "".join(c.function.arguments for c in calls) == '{"city": "Paris"}'


def test_earlier_reasoning_reaches_the_template_under_both_names(served):
    backend, client = served
    backend.script = ["<think>ok</think>Fine."]
    for name in ("reasoning", "reasoning_content"):
        history = ASK + [{"role": "assistant", "content": "Paris.", name: "Capital: Paris."},
                         {"role": "user", "content": "And Italy?"}]
        client.chat.completions.create(model=MODEL, messages=history)
        assert backend.requests[-1].messages[1]["reasoning_content"] == "Capital: Paris."


# Where templates leave the thought: Qwen3's hybrids (closed only when thinking is off), R1 (always
# open), Qwen3.x (open unless off), Qwen3-Instruct-2507's kind (</think> only to strip old thoughts).
HYBRID = QWEN3_TEMPLATE
QWEN3X = ("{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}"
          "<think>\n{% endif %}{% endif %}")
INSTRUCT = ("{% for m in messages %}{{ m.content.split('</think>')[-1] }}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.network  # the default model's tokenizer
@pytest.mark.parametrize("template, opens", [(HYBRID, (False, False, False)), (R1_TEMPLATE, (True, True, True)),
                                             (QWEN3X, (True, True, False)), (INSTRUCT, (False, False, False))])
def test_the_replica_reads_where_the_generation_prompt_leaves_the_thought(default_model, template, opens):
    import copy

    tokenizer = copy.deepcopy(default_model[1])
    tokenizer.chat_template = template
    assert reasoning_format(template) == THINK and thought_opens(tokenizer) == opens
    if template is QWEN3X:  # the operator's default counts where the request leaves it unset
        assert thought_opens(tokenizer, {"enable_thinking": False}) == (False, True, False)


@pytest.mark.network  # the default model
def test_the_replica_counts_the_thoughts_tokens_for_usage():
    from deployments.app.local_server import local_server

    # R1's template opens the thought; the 135M model never closes it in 6 tokens: all of them count
    with local_server(chat_template=R1_TEMPLATE, engine=dict(kv_cache_memory="16MiB", max_model_len=256)) as (replica, url):
        assert replica.info.reasoning_format == THINK and replica.info.thought_opens == (True, True, True)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
            chat = client.chat.completions.create(model=replica.info.model_id, messages=ASK, max_tokens=6,
                                                  temperature=0)
            streamed = [c.usage for c in client.chat.completions.create(
                model=replica.info.model_id, messages=ASK, max_tokens=6, temperature=0, stream=True,
                stream_options={"include_usage": True}) if c.usage]
    assert chat.choices[0].message.content is None and chat.choices[0].message.reasoning
    assert chat.usage.completion_tokens == 6 and chat.usage.completion_tokens_details.reasoning_tokens == 6
    assert streamed[-1].completion_tokens_details.reasoning_tokens == 6


@pytest.mark.parametrize("opens, extra, script, expected", [
    ((False, False, False), {}, ["Paris."], (None, "Paris.")),  # Qwen3-Instruct-2507's kind: no thought
    ((False, False, False), {}, ["<think>\nHm.</think>", "Paris."], ("Hm.", "Paris.")),  # a hybrid thinks
    ((True, True, False), {}, ["Hm.</think>", "Paris."], ("Hm.", "Paris.")),  # the prompt opened it
    ((True, True, False), {"chat_template_kwargs": {"enable_thinking": False}}, ["Paris."], (None, "Paris.")),
])
def test_auto_splits_as_the_prompt_left_the_thought(opens, extra, script, expected):
    backend = ReasoningBackend(THINK)
    backend.script = script

    async def info():
        found = await ReasoningBackend.model_info(backend)
        found.thought_opens = opens
        return found

    backend.model_info = info
    with serve_on_loopback(build_app(backend)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=5.0) as client:
            message = client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra).choices[0].message
            streamed = _streamed(client, messages=ASK, extra_body=extra)[:2]
    assert (getattr(message, "reasoning", None), message.content) == expected
    assert streamed == expected


def test_a_model_without_a_reasoning_format_keeps_the_thought_in_the_content():
    backend = ReasoningBackend(reasoning=None)
    backend.script = THOUGHT
    with serve_on_loopback(build_app(backend)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=5.0) as client:
            message = client.chat.completions.create(model=MODEL, messages=ASK).choices[0].message
    assert message.content == "".join(THOUGHT) and getattr(message, "reasoning", None) is None
    assert "skip_special_tokens" not in sampling_set(backend.requests[-1])
    assert not backend.requests[-1].count_reasoning  # nothing split, nothing counted
