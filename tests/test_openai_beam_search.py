"""vLLM's use_beam_search through the official openai client, on the real engine (CPU): the n
best beams as n choices, best first, the same sequences as transformers' num_beams search where
the two define the same search; refusals are 400s naming the field (test_vllm_extras.py)."""

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from openai_support import served_openai  # noqa: E402

pytestmark = pytest.mark.network  # the default model
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def served():
    with served_openai() as (replica, client, url):
        yield replica, client, url


def test_completions_beams_are_transformers_beam_search(served, default_model):
    replica, client, _ = served
    model, tokenizer = default_model
    ids = tokenizer(PROMPT, add_special_tokens=True)["input_ids"]
    plain = model.generate(torch.tensor([ids]), num_beams=3, num_return_sequences=3, max_new_tokens=8,
                           do_sample=False, eos_token_id=None, pad_token_id=0, length_penalty=0.0)
    out = client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=8, temperature=0,
                                    extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [tokenizer.decode(row[len(ids):], skip_special_tokens=True)
                                             for row in plain.tolist()]
    assert {c.finish_reason for c in out.choices} == {"length"}
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 3 * 8
    assert replica.llm.stats().used_blocks == 0  # every beam's step request gave its blocks back


def test_chat_beams_end_on_eos_and_rank_by_length_penalty(served):
    _, client, _ = served
    messages = [{"role": "user", "content": "Name a fruit."}]
    args = dict(model=MODEL, messages=messages, n=2, max_tokens=24, temperature=0)
    short = client.chat.completions.create(**args, extra_body={"use_beam_search": True, "length_penalty": 0.0})
    assert [c.index for c in short.choices] == [0, 1]
    assert all(c.message.content for c in short.choices)
    assert any(c.finish_reason == "stop" for c in short.choices)  # a beam ended on the chat's end token
    again = client.chat.completions.create(**args, extra_body={"use_beam_search": True, "length_penalty": 0.0})
    assert [c.message.content for c in again.choices] == [c.message.content for c in short.choices]


def test_a_client_that_leaves_stops_every_beam_and_frees_their_blocks(served):
    import time

    replica, _, url = served
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=1.5) as impatient:
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model=MODEL, prompt=PROMPT, n=4, max_tokens=1000,  # minutes of steps
                                         extra_body={"use_beam_search": True, "ignore_eos": True})
    deadline = time.monotonic() + 60
    while replica.llm.stats().num_running or replica.llm.stats().num_waiting or replica.llm.stats().used_blocks:
        assert time.monotonic() < deadline, replica.llm.stats()
        time.sleep(0.1)
