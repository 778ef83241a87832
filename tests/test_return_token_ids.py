"""vLLM's return_token_ids through the official openai client, on the real engine (CPU): the
prompt's token ids and each choice's, whole and streamed (agent and RL loops read them instead of
tokenizing the text again)."""

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from openai_support import served_openai  # noqa: E402

pytestmark = pytest.mark.network  # the default model
MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def served():
    with served_openai() as (replica, client, url):
        yield replica, client


def extra(obj, name):
    return (obj.model_extra or {}).get(name)


def test_chat_answers_carry_the_prompt_and_answer_token_ids_whole_and_streamed(served):
    replica, client = served
    args = dict(model=MODEL, messages=ASK, max_tokens=8, temperature=0, extra_body=IDS)
    whole = client.chat.completions.create(**args)
    prompt = replica.tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    assert extra(whole, "prompt_token_ids") == replica.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = extra(whole.choices[0], "token_ids")
    assert len(ids) == whole.usage.completion_tokens
    assert replica.tokenizer.decode(ids, skip_special_tokens=True) == whole.choices[0].message.content

    chunks = list(client.chat.completions.create(**args, stream=True))
    assert extra(chunks[0], "prompt_token_ids") == extra(whole, "prompt_token_ids")
    assert all(extra(c, "prompt_token_ids") is None for c in chunks[1:])  # the first chunk only
    assert [t for c in chunks for choice in c.choices for t in extra(choice, "token_ids") or []] == ids

    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    assert extra(plain, "prompt_token_ids") is None and extra(plain.choices[0], "token_ids") is None


def test_completion_choices_carry_their_prompts_ids_with_n_and_several_prompts(served):
    replica, client = served
    prompts = ["The capital of France is", "One, two, three,"]
    args = dict(model=MODEL, prompt=prompts, max_tokens=5, temperature=0.8, seed=3, n=2, extra_body=IDS)
    whole = client.completions.create(**args)
    assert len(whole.choices) == 4
    for choice in whole.choices:
        assert extra(choice, "prompt_token_ids") == replica.tokenizer(prompts[choice.index // 2])["input_ids"]
        assert replica.tokenizer.decode(extra(choice, "token_ids")) == choice.text
    streamed: dict[int, list[int]] = {}
    prompt_ids: dict[int, list] = {}
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).extend(extra(choice, "token_ids") or [])
            if extra(choice, "prompt_token_ids") is not None:
                prompt_ids.setdefault(choice.index, []).append(extra(choice, "prompt_token_ids"))
    assert streamed == {c.index: extra(c, "token_ids") for c in whole.choices}  # seeded: the same samples
    assert prompt_ids == {c.index: [extra(c, "prompt_token_ids")] for c in whole.choices}  # once a choice


def test_a_format_that_holds_text_back_still_streams_every_token_id(served):
    """A named tool call's arguments are parsed before they go out: the ids come on chunks of their own."""
    _, client = served
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool],
                tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=30,
                temperature=0, extra_body=IDS)
    whole = client.chat.completions.create(**args)
    ids = extra(whole.choices[0], "token_ids")
    assert whole.choices[0].message.tool_calls and len(ids) == whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert [t for c in chunks for choice in c.choices for t in extra(choice, "token_ids") or []] == ids


def test_ids_of_text_held_back_go_out_on_an_empty_chunk_of_their_own():
    """Where a format holds a delta's text back (a partial tag, a tool call still being parsed) and
    makes no chunk for it, its token ids still go out, on a chunk with an empty delta."""
    from deployments.api.formats import ChatFormat, CompletionFormat, with_token_ids
    from deployments.api.protocol import GenerateDelta

    delta = GenerateDelta(request_id="r", text="<thi", token_ids=[7, 8], finished=False, finish_reason=None,
                          prompt_tokens=3, completion_tokens=2, index=1, prompt_token_ids=[1, 2, 3])
    chat = ChatFormat("r", MODEL)
    [chunk] = with_token_ids(chat, [], 1, delta)
    assert chunk.choices[0].index == 1 and chunk.choices[0].token_ids == [7, 8]
    assert chunk.choices[0].delta.content is None and chunk.choices[0].finish_reason is None
    completion = CompletionFormat("r", MODEL)
    [chunk] = with_token_ids(completion, [], 1, delta)
    assert (chunk.choices[0].text, chunk.choices[0].token_ids, chunk.choices[0].prompt_token_ids) == ("", [7, 8],
                                                                                                      [1, 2, 3])
    made = completion.text(1, "ab")
    assert with_token_ids(completion, made, 1, delta) == made and made[0].choices[0].token_ids == [7, 8]
