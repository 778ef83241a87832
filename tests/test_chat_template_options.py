"""A chat request's template options, as vLLM takes them: chat_template_kwargs (enable_thinking and
the like), add_generation_prompt, continue_final_message with echo (prefilling the answer), and
the errors a template's refusal or a bad option gives (400s naming the field, never 500s)."""

import copy
import json
import urllib.error
import urllib.request

import pytest

import ponytail
from deployments.api.prompts import chat_token_ids
from ponytail import check_chat_template_options
from deployments.api.protocol import GenerateRequest

ASK = [{"role": "user", "content": "Capital of France?"}]
PREFILLED = ASK + [{"role": "assistant", "content": "The capital of France is"}]
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is false %}"
                     "<think></think>{% endif %}{% endif %}")
STRICT_TEMPLATE = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
                   "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
                   "{% endif %}{{ m.content }}{% endfor %}")


@pytest.mark.parametrize("kwargs, generation, cont, messages, words", [
    ({"tokenize": False}, True, False, ASK, "chat_template_kwargs=['tokenize'] sets what the server sets itself"),
    ({"messages": [], "tools": []}, True, False, ASK, "chat_template_kwargs=['messages', 'tools']"),
    (["enable_thinking"], True, False, ASK, "chat_template_kwargs=['enable_thinking'] is invalid; allowed: an object"),
    (None, True, True, PREFILLED, "continue_final_message=true needs add_generation_prompt=false"),
    (None, False, True, ASK + [{"role": "assistant", "content": " "}], "needs a last message with text"),
])
def test_bad_options_are_refused_naming_the_field(kwargs, generation, cont, messages, words):
    with pytest.raises(ponytail.ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        check_chat_template_options(kwargs, generation, cont, messages)
    check_chat_template_options({"enable_thinking": False}, False, True, PREFILLED)  # a good set passes


# ------------------------------------------------------------------ the API, over a scripted backend
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from deployments.app.local_server import serve_on_loopback  # noqa: E402
from deployments.api.server import build_app  # noqa: E402
from test_tool_choice_auto import MODEL, ScriptedBackend  # noqa: E402


@pytest.fixture(scope="module")
def scripted():
    backend = ScriptedBackend(tool_call_format=None)
    with serve_on_loopback(build_app(backend)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=5.0) as client:
            yield backend, client


def test_the_options_reach_the_engine_request(scripted):
    backend, client = scripted
    backend.script = [" Paris", "."]
    client.chat.completions.create(model=MODEL, messages=ASK, extra_body={
        "chat_template_kwargs": {"enable_thinking": False, "custom": [1, 2]}, "add_generation_prompt": False})
    request = backend.requests[-1]
    assert request.chat_template_kwargs == {"enable_thinking": False, "custom": [1, 2]}
    assert (request.add_generation_prompt, request.continue_final_message) == (False, False)
    client.chat.completions.create(model=MODEL, messages=ASK)
    request = backend.requests[-1]
    assert (request.chat_template_kwargs, request.add_generation_prompt, request.continue_final_message) == (
        None, True, False)


def test_echo_puts_the_continued_message_in_front_whole_and_streamed(scripted):
    backend, client = scripted
    backend.script = [" Paris", "."]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    whole = client.chat.completions.create(model=MODEL, messages=PREFILLED, extra_body=extra)
    assert whole.choices[0].message.content == "The capital of France is Paris."
    assert backend.requests[-1].continue_final_message is True
    chunks = list(client.chat.completions.create(model=MODEL, messages=PREFILLED, extra_body=extra, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The capital of France is Paris."
    without = client.chat.completions.create(model=MODEL, messages=PREFILLED, extra_body={**extra, "echo": False})
    assert without.choices[0].message.content == " Paris."
    user_last = client.chat.completions.create(model=MODEL, messages=ASK, extra_body={"echo": True})
    assert user_last.choices[0].message.content == " Paris."  # echo repeats only the assistant's own message


@pytest.mark.parametrize("extra, param, words", [
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "sets what the server sets"),
    ({"continue_final_message": True}, "continue_final_message", "needs add_generation_prompt=false"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "chat_template per request"),
    ({"chat_template_kwargs": "yes"}, "chat_template_kwargs", "should be an object"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "reasoning_effort"),
])
def test_bad_options_are_400s_naming_the_field(scripted, extra, param, words):
    from test_vllm_extras import assert_refused

    assert_refused(scripted, PREFILLED, extra, param, words)


# ------------------------------------------------------------------ the real tokenizer and engine
@pytest.fixture(scope="module")
def tokenizer(default_model):
    return copy.deepcopy(default_model[1])


@pytest.mark.network  # the default model's tokenizer
def test_the_template_renders_with_the_options(tokenizer):
    tokenizer.chat_template = THINKING_TEMPLATE

    def text(**fields):
        return tokenizer.decode(chat_token_ids(tokenizer, ASK, request=GenerateRequest(messages=ASK, **fields)))

    assert text().endswith("<|im_start|>assistant\n")
    assert text(chat_template_kwargs={"enable_thinking": False}).endswith("<|im_start|>assistant\n<think></think>")
    assert text(add_generation_prompt=False).endswith("Capital of France?<|im_end|>\n")
    request = GenerateRequest(messages=PREFILLED, add_generation_prompt=False, continue_final_message=True)
    continued = tokenizer.decode(chat_token_ids(tokenizer, PREFILLED, request=request))
    assert continued.endswith("<|im_start|>assistant\nThe capital of France is")  # open: no <|im_end|>


@pytest.mark.network
def test_a_template_that_refuses_the_conversation_is_a_config_error_naming_messages(tokenizer):
    tokenizer.chat_template = STRICT_TEMPLATE
    with pytest.raises(ponytail.ConfigError, match="messages: the chat template refused them: Conversation roles "
                                                   "must alternate .*allowed: a conversation the model's template"):
        chat_token_ids(tokenizer, ASK + ASK)
    assert chat_token_ids(tokenizer, ASK)  # an alternating one renders


@pytest.mark.network
def test_a_template_that_drops_the_message_to_continue_is_a_config_error(tokenizer):
    tokenizer.chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}<|im_end|>{% endfor %}"  # no content
    request = GenerateRequest(messages=PREFILLED, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ponytail.ConfigError, match="continue_final_message=true: .*allowed: a template that writes "
                                                   "the last message as sent, or continue_final_message=false"):
        chat_token_ids(tokenizer, PREFILLED, request=request)


@pytest.mark.network
def test_a_prefilled_answer_continues_as_the_same_prompt_would_through_completions():
    """continue_final_message + echo on the real engine: the answer is the prefill and its greedy
    continuation, and /tokenize with the same options gives the prompt that completions continues alike."""
    from openai_support import served_openai

    with served_openai() as (_, client, url):
        extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
        chat = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=PREFILLED, max_tokens=4,
                                              temperature=0, extra_body=extra)
        body = json.dumps({"messages": PREFILLED, "continue_final_message": True, "add_generation_prompt": False})
        request = urllib.request.Request(url + "/tokenize", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            ids = json.loads(response.read())["tokens"]
        plain = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=4, temperature=0)
        assert chat.choices[0].message.content == PREFILLED[-1]["content"] + plain.choices[0].text
        assert chat.usage.prompt_tokens == len(ids)
        opened = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=PREFILLED, max_tokens=1)
        assert opened.usage.prompt_tokens > len(ids)  # a closed message and a new assistant header
        body = json.dumps({"messages": ASK + ASK, "continue_final_message": True})
        request = urllib.request.Request(url + "/tokenize", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=60)
        error = json.loads(caught.value.read())["error"]
        assert caught.value.code == 400 and error["param"] == "continue_final_message", error


# ------------------------------------------------------------------ the operator's defaults
def test_the_apps_defaults_are_read_from_json_and_checked():
    pytest.importorskip("ray.serve")
    from pydantic import ValidationError

    from deployments.app.args import AppArgs

    from deployments.app.builder import engine_arguments, router_arguments

    args = AppArgs(default_chat_template_kwargs='{"enable_thinking": false}')  # as a flag gives it
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    assert engine_arguments(args, gpu=False)["default_chat_template_kwargs"] == {"enable_thinking": False}
    assert router_arguments(AppArgs(router="prefix", default_chat_template_kwargs={"x": 1}))[
        "default_chat_template_kwargs"] == {"x": 1}
    with pytest.raises(ValidationError, match="default_chat_template_kwargs='{enable' is not JSON"):
        AppArgs(default_chat_template_kwargs="{enable")
    with pytest.raises(ValidationError, match=r"default_chat_template_kwargs=\['tokenize'\] sets what the server"):
        AppArgs(default_chat_template_kwargs={"tokenize": True})


def test_the_api_puts_the_defaults_under_the_requests_own_and_reads_thinking_from_both():
    from deployments.api.reasoning import QWEN3
    from test_reasoning import ReasoningBackend

    class Defaults(ReasoningBackend):
        async def model_info(self):
            info = await super().model_info()
            info.chat_template_kwargs = {"enable_thinking": False, "style": "terse"}
            return info

    backend = Defaults(QWEN3)
    backend.script = ["<think>hm</think>Paris."]
    with serve_on_loopback(build_app(backend)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=5.0) as client:
            off = client.chat.completions.create(model=MODEL, messages=ASK).choices[0].message
            assert backend.requests[-1].chat_template_kwargs == {"enable_thinking": False, "style": "terse"}
            on = client.chat.completions.create(model=MODEL, messages=ASK, extra_body={
                "chat_template_kwargs": {"enable_thinking": True}}).choices[0].message
            assert backend.requests[-1].chat_template_kwargs == {"enable_thinking": True, "style": "terse"}
    # thinking off: nothing is thought (a stray </think> is dropped, as vLLM's qwen3 parser does)
    assert (getattr(off, "reasoning", None), off.content) == (None, "<think>hmParis.")
    assert (on.reasoning, on.content) == ("hm", "Paris.")


@pytest.mark.network
def test_a_replica_and_the_prefix_router_render_with_the_defaults(default_model):
    pytest.importorskip("ray.serve")
    import asyncio

    from deployments.api.prompts import tokenizer_fingerprint
    from deployments.app.replica import EngineReplica
    from test_prefix_routing import make_router
    from test_router import FakeClock

    defaults = {"enable_thinking": False}
    replica = EngineReplica(engine=dict(device="cpu", kv_cache_memory="16MiB", max_num_seqs=2, max_model_len=256),
                            chat_template=THINKING_TEMPLATE, default_chat_template_kwargs=defaults)
    assert replica.info.chat_template_kwargs == defaults

    def rendered(options=None):
        return replica.tokenizer.decode(asyncio.run(replica.tokenize(None, ASK, options)))

    assert rendered().endswith("<think></think>")
    assert rendered({"chat_template_kwargs": {"enable_thinking": True}}).endswith("assistant\n")  # the request wins
    router = make_router(FakeClock(), tokenizer=ponytail.load_tokenizer(None), chat_template=THINKING_TEMPLATE,
                         default_chat_template_kwargs=defaults)
    assert router._fingerprint == replica._fingerprint  # so the replica takes the router's ids
    assert router._fingerprint != tokenizer_fingerprint(replica.tokenizer)  # which differ from those without
    assert router._token_ids(GenerateRequest(messages=ASK)) == asyncio.run(replica.tokenize(None, ASK))
