"""n > 1 and best_of through the official openai client, on the real engine (CPU): choices with
their index, streamed too; equal when greedy, distinct and reproducible with a seed; best_of's
ranking; echo per choice; a disconnect frees every sample's blocks."""

import time

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from openai_support import served_openai  # noqa: E402

pytestmark = pytest.mark.network  # the default model
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Once upon a time, in a small village,"
CHAT = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def served():
    with served_openai() as (replica, client, url):
        yield replica, client, url


def test_n4_returns_four_choices_equal_when_greedy(served):
    _, client, _ = served
    out = client.completions.create(model=MODEL, prompt=PROMPT, n=4, max_tokens=8, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert len({c.text for c in out.choices}) == 1 and out.choices[0].text
    one = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.choices[0].text == one.choices[0].text
    assert out.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert out.usage.completion_tokens == 4 * one.usage.completion_tokens


def test_seeded_samples_differ_and_are_reproducible(served):
    _, client, _ = served
    args = dict(model=MODEL, prompt=PROMPT, n=4, max_tokens=12, temperature=1.0, seed=1234)
    first = [c.text for c in client.completions.create(**args).choices]
    again = [c.text for c in client.completions.create(**args).choices]
    assert first == again
    assert len(set(first)) == 4


def test_streamed_choices_carry_their_index_and_match_the_full_answer(served):
    _, client, _ = served
    args = dict(model=MODEL, prompt=PROMPT, n=3, max_tokens=10, temperature=1.0, seed=99)
    full = client.completions.create(**args)
    texts, reasons = {}, {}
    for chunk in client.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    assert texts == {c.index: c.text for c in full.choices}
    assert reasons == {c.index: c.finish_reason for c in full.choices}
    assert usage.completion_tokens == full.usage.completion_tokens


def test_chat_n_streamed_and_not(served):
    _, client, _ = served
    args = dict(model=MODEL, messages=CHAT, n=2, max_tokens=8, temperature=1.0, seed=5)
    full = client.chat.completions.create(**args)
    assert [c.index for c in full.choices] == [0, 1]
    texts = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert texts == {c.index: c.message.content for c in full.choices}


def test_best_of_returns_the_n_most_likely_of_its_samples(served):
    _, client, _ = served
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=42)
    samples = client.completions.create(**args, n=4, logprobs=0).choices
    best = client.completions.create(**args, n=2, best_of=4, logprobs=0).choices
    ranked = sorted(samples, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert [c.text for c in best] == [c.text for c in ranked[:2]]
    assert [c.index for c in best] == [0, 1]
    plain = client.completions.create(**args, n=1, best_of=4).choices
    assert [c.text for c in plain] == [ranked[0].text] and plain[0].logprobs is None


def test_echo_prefixes_every_choice(served):
    _, client, _ = served
    out = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=4, temperature=1.0, seed=3,
                                    echo=True)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=4, temperature=1.0, seed=3)
    assert [c.text for c in out.choices] == [PROMPT + c.text for c in plain.choices]


def test_a_client_gone_mid_stream_frees_every_sample(served):
    replica, client, _ = served
    stream = client.completions.create(model=MODEL, prompt=PROMPT, n=4, max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    seen = set()
    for chunk in stream:
        seen.update(c.index for c in chunk.choices)
        if seen == {0, 1, 2, 3}:  # every sample is running
            break
    assert replica.llm.stats().num_running == 4
    stream.close()
    deadline = time.monotonic() + 30
    while (replica.llm.stats().used_blocks or replica.llm.stats().num_running) and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = replica.llm.stats()
    assert stats.num_running == 0 and stats.used_blocks == 0 and stats.promised_blocks == 0
