"""logprobs, top_logprobs and echo through the official openai client, on the real engine (CPU)."""

import math

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from openai_support import served_openai  # noqa: E402
from test_prompt_logprobs import plain_log_softmax  # noqa: E402

pytestmark = pytest.mark.network  # the default model
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def served():
    with served_openai() as (replica, client, url):
        yield replica, client


def plain_prompt_logprobs(replica, ids):
    """Plain transformers, fp32 on the CPU: log_softmax of the prompt's logits, sdpa, no cache."""
    return plain_log_softmax(replica.llm.engine.model, ids)


def test_echo_prompt_logprobs_equal_plain_transformers(served):
    replica, client = served
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                    logprobs=1)
    choice = out.choices[0]
    ids = replica.tokenizer(PROMPT)["input_ids"]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1 == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens[: len(ids)]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    reference = plain_prompt_logprobs(replica, ids)
    for position in range(1, len(ids)):
        assert lp.token_logprobs[position] == pytest.approx(reference[position - 1, ids[position]].item(), abs=1e-4)
        best = reference[position - 1].argmax().item()
        assert lp.top_logprobs[position][replica.tokenizer.decode([best])] == pytest.approx(
            reference[position - 1, best].item(), abs=1e-4)
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    # The generated token: greedy, so its logprob is the best in its top_logprobs (what lm-eval checks).
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()))
    assert choice.text == PROMPT + lp.tokens[-1]


def test_completion_logprobs_without_echo_and_streamed_agree(served):
    _, client = served
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    full = client.completions.create(**args).choices[0]
    assert len(full.logprobs.tokens) == 6 and "".join(full.logprobs.tokens) == full.text
    assert full.logprobs.text_offset[0] == 0
    for token, value, top in zip(full.logprobs.tokens, full.logprobs.token_logprobs, full.logprobs.top_logprobs):
        assert value <= 0 and len(top) in (3, 4) and top[token] == value  # 3 best, and the chosen one
    streamed = [c for c in client.completions.create(**args, stream=True) if c.choices and c.choices[0].logprobs]
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    values = [v for c in streamed for v in c.choices[0].logprobs.token_logprobs]
    offsets = [o for c in streamed for o in c.choices[0].logprobs.text_offset]
    assert tokens == full.logprobs.tokens and offsets == full.logprobs.text_offset
    assert values == pytest.approx(full.logprobs.token_logprobs, abs=1e-5)


def test_echo_without_logprobs_returns_the_prompt_first(served):
    _, client = served
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.choices[0].text == PROMPT + plain.choices[0].text
    assert out.choices[0].logprobs is None


def test_chat_logprobs_and_top_logprobs_streamed_too(served):
    _, client = served
    args = dict(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**args).choices[0]
    content = full.logprobs.content
    # Every generated token, the EOS that ended the answer included (its text is not in the content).
    assert "".join(c.token for c in content) in (full.message.content, full.message.content + "<|im_end|>")
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy: the chosen is the best
        assert bytes(item.bytes).decode() == item.token
        assert math.isfinite(item.logprob)
    chunks = list(client.chat.completions.create(**args, stream=True))
    streamed = [i for c in chunks if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert [i.token for i in streamed] == [i.token for i in content]
    assert [i.logprob for i in streamed] == pytest.approx([i.logprob for i in content], abs=1e-5)
    without = client.chat.completions.create(**{**args, "logprobs": False, "top_logprobs": None})
    assert without.choices[0].logprobs is None
    just_logprobs = client.chat.completions.create(**{**args, "top_logprobs": None}).choices[0]
    assert all(item.top_logprobs == [] for item in just_logprobs.logprobs.content)


def test_tracked_token_logprobs_on_chat_and_completions(served):
    """vLLM's logprob_token_ids: label tokens' logprobs at each position, instead of the top ones."""
    replica, client = served
    yes, no = (replica.tokenizer.encode(word, add_special_tokens=False)[0] for word in (" yes", " no"))
    args = dict(model=MODEL, max_tokens=3, temperature=0, extra_body={"logprob_token_ids": [yes, no]})
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Is Paris in France?"}],
                                          logprobs=True, **args).choices[0]
    for item in chat.logprobs.content:
        listed = {top.token: top.logprob for top in item.top_logprobs}
        assert {" yes", " no"} <= set(listed) and set(listed) <= {" yes", " no", item.token}  # the sampled one too
        assert listed[item.token] == pytest.approx(item.logprob)
        assert max(listed.values()) <= 0
    streamed = [i for c in client.chat.completions.create(
        messages=[{"role": "user", "content": "Is Paris in France?"}], logprobs=True, stream=True, **args)
        if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert [len(i.top_logprobs) for i in streamed] == [len(i.top_logprobs) for i in chat.logprobs.content]

    completion = client.completions.create(prompt=PROMPT, logprobs=1, **args).choices[0]
    ids = replica.tokenizer(PROMPT)["input_ids"]
    reference = plain_prompt_logprobs(replica, ids + [replica.tokenizer.encode(completion.logprobs.tokens[0],
                                                                               add_special_tokens=False)[0]])
    first = completion.logprobs.top_logprobs[0]
    assert {" yes", " no"} <= set(first) and len(first) <= 3
    assert first[" yes"] == pytest.approx(reference[len(ids) - 1, yes].item(), abs=1e-4)
    assert first[" no"] == pytest.approx(reference[len(ids) - 1, no].item(), abs=1e-4)


@pytest.mark.parametrize("body, message", [
    (dict(messages=[{"role": "user", "content": "hi"}], logprob_token_ids=[1]),
     "logprob_token_ids=[1] needs logprobs=true; allowed: logprob_token_ids only together with logprobs=true"),
    (dict(prompt="hi", logprob_token_ids=[1, 2]),
     "logprob_token_ids=[1, 2] needs logprobs; allowed: logprob_token_ids only together with logprobs"),
    (dict(prompt="hi", logprobs=1, logprob_token_ids=[1, 10**9]),
     "logprob_token_ids=[1000000000] are outside the vocabulary: allowed: token ids in [0, 49152)"),
    (dict(prompt="hi", logprobs=1, logprob_token_ids=[]),
     "logprob_token_ids=[] is invalid; allowed: None or a list of 1 to 128 token ids"),
    (dict(prompt="hi", logprobs=1, logprob_token_ids=[1], use_beam_search=True, n=2),
     "logprob_token_ids=[1] cannot be combined with use_beam_search=true"),
])
def test_tracked_token_logprobs_refused_by_name(served, body, message):
    import openai

    _, client = served
    create = client.chat.completions.create if "messages" in body else client.completions.create
    fields = {k: v for k, v in body.items() if k in ("messages", "prompt", "logprobs", "n")}
    extra = {k: v for k, v in body.items() if k not in fields}
    with pytest.raises(openai.BadRequestError) as error:
        create(model=MODEL, max_tokens=2, extra_body=extra, **fields)
    assert message in error.value.response.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices  # the server goes on
