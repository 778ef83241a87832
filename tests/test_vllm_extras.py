"""vLLM's request extras beyond the sampling fields: truncate_prompt_tokens, bad_words and
allowed_token_ids run (on the real engine), and those the engine cannot honour yet are 400s naming
them, never silently ignored."""

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from deployments.app.local_server import serve_on_loopback  # noqa: E402
from deployments.api.server import build_app  # noqa: E402
from test_tool_choice_auto import MODEL, ScriptedBackend  # noqa: E402
from request_fields import sampling_set  # noqa: E402
from deployments.api.protocol import GenerateRequest  # noqa: E402
from ponytail import SamplingParams  # noqa: E402

ASK = [{"role": "user", "content": "Capital of France?"}]


@pytest.fixture(scope="module")
def scripted():
    backend = ScriptedBackend(tool_call_format=None)
    backend.script = ["Paris."]
    with serve_on_loopback(build_app(backend)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=5.0) as client:
            yield backend, client


@pytest.mark.parametrize("extra, param, words", [
    ({"length_penalty": 0.5}, "length_penalty", "ranks beams and needs use_beam_search=true"),
    ({"use_beam_search": True, "stream": True}, "stream", "stream=true cannot be combined with use_beam_search"),
    ({"use_beam_search": True, "logprobs": True}, "logprobs", "logprobs=true cannot be combined with "
                                                               "use_beam_search=true; allowed with it: n, max_tokens"),
    ({"use_beam_search": True, "logprobs": True, "top_logprobs": 2}, "top_logprobs", "top_logprobs=2 cannot be"),
    ({"use_beam_search": True, "top_p": 0.5}, "top_p", "top_p=0.5 cannot be combined with use_beam_search"),
    ({"use_beam_search": True, "n": 11}, "n", "n=11 with use_beam_search=true asks for 11 beams; allowed: at most 10"),
    ({"priority": -1}, "priority", "first come, first served"),
    ({"logprob_token_ids": [3]}, "logprob_token_ids", "needs logprobs=true"),
    ({"cache_salt": ""}, "cache_salt", "at least 1 character"),
    ({"thinking_token_budget": -2}, "thinking_token_budget", "allowed: None, -1 (no limit) or an integer >= 0"),
    ({"thinking_token_budget": 5, "response_format": {"type": "json_object"}}, "thinking_token_budget",
     "allowed: None with structured_outputs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "with stream=true is not supported"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "positive number of tokens"),
    ({"truncation_side": "middle"}, "truncation_side", "'left' or 'right'"),
    ({"return_prompt_text": True}, "return_prompt_text", "not supported"),
    ({"return_token_offsets": True}, "return_token_offsets", "not supported"),
    ({"repetition_detection": {"max_pattern_size": 4}}, "repetition_detection", "not supported"),
    ({"vllm_xargs": {"my_processor": 1}}, "vllm_xargs", "not supported"),
    ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params", "not supported"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "greater than or equal to -1"),
])
def test_extras_the_engine_cannot_honour_are_400s_naming_them(scripted, extra, param, words):
    assert_refused(scripted, ASK, extra, param, words)


def assert_refused(scripted, messages, extra, param, words):
    """A chat request with `extra` is a 400 naming `param` with `words`, refused before the backend."""
    backend, client = scripted
    before = len(backend.requests)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, extra_body=extra)
    error = caught.value.body
    assert error["param"] == param and words in error["message"], error
    assert len(backend.requests) == before


def test_their_default_values_change_nothing_and_pass(scripted):
    backend, client = scripted
    extra = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0, "bad_words": [],
             "return_tokens_as_token_ids": False, "add_special_tokens": False}
    assert client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra).choices[0].message.content \
        == "Paris."
    completion = client.completions.create(model=MODEL, prompt="x", extra_body={"add_special_tokens": True})
    assert completion.choices[0].text == "Paris."


def test_add_special_tokens_reaches_the_replica_on_both_endpoints(scripted):
    backend, client = scripted
    sent = {}
    for flag in (True, False, None):
        extra = {} if flag is None else {"add_special_tokens": flag}
        client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra)
        sent["chat", flag] = backend.requests[-1].add_special_tokens
        client.completions.create(model=MODEL, prompt="x", extra_body=extra)
        sent["text", flag] = backend.requests[-1].add_special_tokens
    assert sent == {("chat", True): True, ("chat", False): False, ("chat", None): False,  # vLLM's defaults
                    ("text", True): True, ("text", False): False, ("text", None): True}
    with pytest.raises(openai.BadRequestError, match="add_special_tokens"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"add_special_tokens": "no"})


def test_thinking_token_budget_reaches_the_engine(scripted):
    backend, client = scripted
    client.chat.completions.create(model=MODEL, messages=ASK, extra_body={"thinking_token_budget": 64})
    assert sampling_set(backend.requests[-1])["thinking_token_budget"] == 64
    client.chat.completions.create(model=MODEL, messages=ASK)
    assert "thinking_token_budget" not in sampling_set(backend.requests[-1])
    client.completions.create(model=MODEL, prompt="x", extra_body={"thinking_token_budget": 8})  # vLLM's, here too
    assert sampling_set(backend.requests[-1])["thinking_token_budget"] == 8
    with pytest.raises(openai.BadRequestError, match="prompt_embeds is not supported"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"prompt_embeds": "AAAA"})


def test_add_special_tokens_decides_the_prompt_token_ids(default_model):
    """With a tokenizer that adds BOS: text gets it unless add_special_tokens=false; chat only with true."""
    import copy

    from tokenizers.processors import TemplateProcessing

    from deployments.api.prompts import prompt_token_ids

    tokenizer = copy.deepcopy(default_model[1])
    bos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    text = tokenizer("Paris", add_special_tokens=False)["input_ids"]
    assert prompt_token_ids(tokenizer, GenerateRequest(prompt="Paris")) == [bos] + text
    assert prompt_token_ids(tokenizer, GenerateRequest(prompt="Paris", add_special_tokens=False)) == text
    chat = prompt_token_ids(tokenizer, GenerateRequest(messages=ASK))
    assert chat[0] != bos
    assert prompt_token_ids(tokenizer, GenerateRequest(messages=ASK, add_special_tokens=True)) == [bos] + chat


def test_a_replica_refuses_truncation_it_cannot_do_naming_the_field():
    """Other Ray apps reach the replica without the API's checks."""
    import ponytail
    from deployments.api.prompt_bounds import PromptBounds

    bounds = PromptBounds(max_prompt_tokens=100, max_model_len=100, max_token_bytes=None)

    def cut(prompt, keep, side="left"):
        return bounds.truncated(prompt, GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=16),
                                                        truncate_prompt_tokens=keep, truncation_side=side))

    assert cut(list(range(50)), 10) == list(range(40, 50))
    assert cut(list(range(150)), -1) == list(range(66, 150))  # room for max_tokens
    assert cut(list(range(50)), 10, "right") == list(range(10))  # vLLM's truncation_side
    with pytest.raises(ponytail.ConfigError, match="truncation_side='up' is invalid; allowed: left"):
        cut(list(range(50)), 10, "up")
    for bad in (0, -2, True, "5"):
        with pytest.raises(ponytail.ConfigError, match=f"truncate_prompt_tokens={bad!r} is invalid; allowed: a "
                                                       "positive integer"):
            cut([1, 2, 3], bad)
    with pytest.raises(ponytail.ConfigError, match="truncate_prompt_tokens needs the prompt as token ids, and this "
                                                   "model has no tokenizer"):
        cut("some text", 2)


@pytest.mark.network  # the default model
def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens():
    from openai_support import served_openai

    with served_openai() as (replica, client, _):
        ids = replica.tokenizer("one two three four five six seven eight nine ten eleven twelve")["input_ids"]
        args = dict(model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0)
        cut = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 5}, **args)
        assert cut.usage.prompt_tokens == 5
        assert cut.choices[0].text == client.completions.create(prompt=ids[-5:], **args).choices[0].text
        head = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 5, "truncation_side":
                                                                  "right"}, **args)
        assert head.choices[0].text == client.completions.create(prompt=ids[:5], **args).choices[0].text
        chat = client.chat.completions.create(messages=ASK, extra_body={"truncate_prompt_tokens": 6}, **args)
        assert chat.usage.prompt_tokens == 6
        too_long = ids * (2 * replica.bounds.max_prompt_tokens // len(ids))  # more than the context holds
        with pytest.raises(openai.BadRequestError, match="prompt has"):
            client.completions.create(prompt=too_long, **args)
        fitted = client.completions.create(prompt=too_long, extra_body={"truncate_prompt_tokens": -1}, **args)
        assert fitted.usage.prompt_tokens == replica.info.max_model_len - 4  # room for max_tokens


@pytest.mark.network  # the default model
def test_bad_words_and_allowed_token_ids_reach_the_engine():
    """vLLM's extras through the official client: the greedy answer's word is banned, or only a
    few tokens may be taken; a bad value is a 400 naming it, and the server keeps serving."""
    from openai_support import served_openai

    with served_openai() as (replica, client, _):
        args = dict(model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0)
        plain = client.completions.create(prompt="The capital of France is", **args).choices[0].text
        assert "Paris" in plain
        banned = client.completions.create(prompt="The capital of France is", extra_body={"bad_words": ["Paris"]},
                                           **args).choices[0].text
        assert "Paris" not in banned and banned != plain
        allowed = replica.tokenizer.convert_tokens_to_ids(["A", "B"])
        chat = client.chat.completions.create(messages=ASK, extra_body={"allowed_token_ids": allowed}, **args)
        assert chat.choices[0].message.content and set(chat.choices[0].message.content) <= {"A", "B"}
        with pytest.raises(openai.BadRequestError, match=r"allowed_token_ids=\[10000000\] are outside the "
                                                         r"vocabulary: allowed: token ids in \[0, 49152\)"):
            client.chat.completions.create(messages=ASK, extra_body={"allowed_token_ids": [10**7]}, **args)
        with pytest.raises(openai.BadRequestError, match=r"bad_words=\[''\] is invalid; allowed: None or a list "
                                                         r"of non-empty strings"):
            client.chat.completions.create(messages=ASK, extra_body={"bad_words": [""]}, **args)
        assert client.completions.create(prompt="The capital of France is", **args).choices[0].text == plain


@pytest.mark.network  # the default model
def test_a_cache_salt_keeps_tenants_prefixes_apart():
    """The same long prompt: cached for the salt that ran it, not for another salt or none."""
    from openai_support import served_openai

    with served_openai() as (replica, client, _):
        prompt = " ".join(f"word{i}" for i in range(120))
        args = dict(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=2, temperature=0)

        def cached(salt):
            usage = client.completions.create(**args, extra_body={} if salt is None else {"cache_salt": salt}).usage
            return usage.prompt_tokens_details.cached_tokens

        assert cached("tenant-a") == 0
        assert cached("tenant-b") == 0 and cached(None) == 0  # another salt, or none: a miss
        assert cached("tenant-a") > 0 and cached(None) > 0  # the same salt, or none again: a hit


DOCUMENTS_TEMPLATE = ("{% for d in documents or [] %}<doc {{ d.title }}>{{ d.text }}</doc>\n{% endfor %}"
                      "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.network  # the default model
def test_documents_reach_a_template_that_reads_them():
    """vLLM's chat `documents` (RAG templates: Command R, Granite) go to the chat template as
    transformers passes them: the prompt counts the documents' tokens."""
    from deployments.app.local_server import local_server

    docs = [{"title": "capitals", "text": "The capital of France is Paris."}]
    with local_server(chat_template=DOCUMENTS_TEMPLATE) as (replica, url):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as client:
            args = dict(model=replica.info.model_id, messages=ASK, max_tokens=1, temperature=0)
            plain = client.chat.completions.create(**args).usage.prompt_tokens
            with_docs = client.chat.completions.create(**args, extra_body={"documents": docs}).usage.prompt_tokens
    rendered = replica.tokenizer.apply_chat_template(ASK, documents=docs, add_generation_prompt=True, tokenize=False,
                                                     chat_template=DOCUMENTS_TEMPLATE)
    assert rendered.startswith("<doc capitals>The capital of France is Paris.</doc>")
    assert with_docs == len(replica.tokenizer(rendered, add_special_tokens=False)["input_ids"]) > plain


@pytest.mark.network  # the default model
def test_prompt_logprobs_come_in_vllms_shape_and_agree_with_echo():
    """vLLM's prompt_logprobs field on both endpoints: per prompt token (None first) its logprob,
    rank and decoded text and the top ones, keyed by token id; the values are echo's."""
    from openai_support import served_openai

    with served_openai() as (replica, client, _):
        prompt = "The capital of France is"
        ids = replica.tokenizer(prompt)["input_ids"]
        args = dict(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=1, temperature=0)
        fielded = client.completions.create(**args, extra_body={"prompt_logprobs": 2}).choices[0]
        echoed = client.completions.create(**args, echo=True, logprobs=2).choices[0].logprobs
        entries = fielded.prompt_logprobs
        assert len(entries) == len(ids) and entries[0] is None and fielded.logprobs is None
        for position, (token, entry) in enumerate(zip(ids[1:], entries[1:]), start=1):
            own = entry[str(token)]
            assert own["logprob"] == pytest.approx(echoed.token_logprobs[position], abs=1e-4)
            assert own["decoded_token"] == replica.tokenizer.decode([token]) and own["rank"] >= 1
            ranked = sorted(entry.values(), key=lambda e: -e["logprob"])
            assert 2 <= len(entry) <= 3 and [e["rank"] for e in ranked[:2]] == [1, 2]
        chat = client.chat.completions.create(model=args["model"], messages=ASK, max_tokens=1,
                                              extra_body={"prompt_logprobs": 0})
        assert len(chat.prompt_logprobs) == chat.usage.prompt_tokens and chat.prompt_logprobs[0] is None
        assert all(len(entry) == 1 for entry in chat.prompt_logprobs[1:])
        plain = client.chat.completions.create(model=args["model"], messages=ASK, max_tokens=1)
        assert "prompt_logprobs" not in plain.model_dump(exclude_unset=True)


@pytest.mark.network  # the default model
def test_priority_is_served_where_the_server_schedules_by_it():
    """scheduling_policy priority (vLLM's --scheduling-policy): a request's priority is taken; the
    default server refuses one, before any engine (the refusal test above)."""
    from deployments.app.local_server import local_server

    with local_server(engine={"scheduling_policy": "priority"}) as (replica, url):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as client:
            chat = client.chat.completions.create(model=replica.info.model_id, messages=ASK, max_tokens=2,
                                                  extra_body={"priority": 3})
            assert chat.choices[0].finish_reason in ("length", "stop")
            with pytest.raises(openai.BadRequestError, match=r"priority='x' is invalid|valid integer"):
                client.chat.completions.create(model=replica.info.model_id, messages=ASK, max_tokens=2,
                                               extra_body={"priority": "x"})


@pytest.mark.network  # the default model
def test_return_tokens_as_token_ids_names_logprob_tokens_by_id():
    from openai_support import served_openai

    with served_openai() as (replica, client, _):
        args = dict(model="SmolLM2-135M-Instruct", max_tokens=5, temperature=0, logprobs=2)
        named = client.completions.create(prompt="The capital of France is", **args)
        by_id = client.completions.create(prompt="The capital of France is", **args,
                                          extra_body={"return_tokens_as_token_ids": True})
        ids = replica.tokenizer(named.choices[0].text, add_special_tokens=False)["input_ids"]
        assert by_id.choices[0].text == named.choices[0].text  # only the logprobs' names change
        assert by_id.choices[0].logprobs.tokens == [f"token_id:{i}" for i in ids]
        assert by_id.choices[0].logprobs.token_logprobs == named.choices[0].logprobs.token_logprobs
        assert all(set(map(str, top)) <= {f"token_id:{i}" for i in range(49152)}
                   for top in by_id.choices[0].logprobs.top_logprobs)
        chat = client.chat.completions.create(messages=ASK, model=args["model"], max_tokens=3, temperature=0,
                                              logprobs=True, top_logprobs=2,
                                              extra_body={"return_tokens_as_token_ids": True})
        content = chat.choices[0].logprobs.content
        assert all(t.token.startswith("token_id:") and len(t.top_logprobs) == 2 for t in content)
        assert all(top.token.startswith("token_id:") for t in content for top in t.top_logprobs)


@pytest.mark.network  # the default model
def test_a_chat_without_max_tokens_runs_to_the_end_of_the_context():
    from deployments.app.local_server import local_server

    with local_server(engine={"max_model_len": 96}) as (replica, url):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as client:
            model = replica.info.model_id
            chat = client.chat.completions.create(model=model, messages=ASK, extra_body={"ignore_eos": True})
            assert chat.choices[0].finish_reason == "length"
            assert chat.usage.completion_tokens == 96 - chat.usage.prompt_tokens  # OpenAI's and vLLM's default
            capped = client.chat.completions.create(model=model, messages=ASK, max_tokens=5)
            assert capped.usage.completion_tokens <= 5
            ids = replica.tokenizer(" ".join(["word"] * 200))["input_ids"][:96]
            filled = [{"role": "user", "content": replica.tokenizer.decode(ids)}]
            with pytest.raises(openai.BadRequestError, match=r"prompt has \d+ tokens; allowed: at most 96"):
                client.chat.completions.create(model=model, messages=filled)
            completion = client.completions.create(model=model, prompt="Hello", extra_body={"ignore_eos": True})
            assert completion.usage.completion_tokens == 16  # completions keep OpenAI's default of 16
    import ponytail

    with pytest.raises(ponytail.ContextLengthError, match=r"prompt has 96 tokens, which leaves no room for an "
                                                          r"answer; allowed: at most 95 \(max_model_len=96\)"):
        replica.bounds.to_context(ponytail.SamplingParams(max_tokens=96), 96, cache_tokens=4096)
    assert replica.bounds.to_context(ponytail.SamplingParams(max_tokens=96), 90, 4096).max_tokens == 6
    assert replica.bounds.to_context(ponytail.SamplingParams(max_tokens=4), 90, 4096).max_tokens == 4  # the bound stays
    # A KV cache smaller than the context bounds it too (the engine refuses what it could never hold)
    assert replica.bounds.to_context(ponytail.SamplingParams(max_tokens=96), 60, cache_tokens=64).max_tokens == 4
    with pytest.raises(ponytail.ContextLengthError, match=r"prompt has 64 tokens, which leaves no room for an answer; "
                                                          r"allowed: at most 63 \(the KV cache holds 64 tokens"):
        replica.bounds.to_context(ponytail.SamplingParams(max_tokens=96), 64, cache_tokens=64)


def test_a_replica_refuses_beam_search_with_sampling_it_does_not_take():
    """A handle caller's GenerateRequest reaches the replica without the API's checks."""
    import asyncio

    import ponytail
    from deployments.app.replica import EngineReplica

    from deployments.api.protocol import ModelInfo

    replica = EngineReplica.__new__(EngineReplica)
    replica.info = ModelInfo(model_id="m", max_model_len=100, block_size=16, device="cpu", device_uuid=None)
    request = GenerateRequest(prompt=[1, 2, 3], sampling=SamplingParams(n=2, logprobs=1),
                              beam_search={"length_penalty": 1.0})
    with pytest.raises(ponytail.ConfigError, match=r"logprobs=1 cannot be combined with beam_search; allowed with "
                                                   r"it: n, max_tokens, temperature"):
        asyncio.run(replica._beam_search([1, 2, 3], request, None))
