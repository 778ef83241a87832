"""logprob_token_ids (vLLM's tracked token logprobs): each step returns the named tokens' logprobs
beside the sampled token's, equal to plain transformers' log_softmax (CPU, fp32)."""

import pytest
from test_prompt_logprobs import model, plain_log_softmax  # noqa: F401 (model: the module's fixture)

import ponytail
from ponytail import ConfigError, SamplingParams


@pytest.fixture(scope="module")
def llm(model):
    return ponytail.LLM(model, kv_cache_memory="4MiB", block_size=4, max_num_seqs=8, max_model_len=128)


def step_log_softmax(model, prompt: list[int], output: list[int]):
    """[len(output), vocab]: the distribution each output token was drawn from, by a plain forward."""
    return plain_log_softmax(model, prompt + output[:-1])[len(prompt) - 1:]


def test_tracked_tokens_equal_plain_log_softmax_beside_rows_that_ask_for_top_ones(llm, model):
    prompts = [[5, 9, 17, 3, 44], [7, 7, 100, 2], [200, 1, 9]]
    tracked = [13, 250, 0, 77]
    params = [SamplingParams(max_tokens=6, temperature=0, logprob_token_ids=tracked),
              SamplingParams(max_tokens=6, temperature=0, logprobs=3),
              SamplingParams(max_tokens=6, temperature=0)]
    outputs = llm.generate(prompts, params)

    out = outputs[0].outputs[0]
    reference = step_log_softmax(model, prompts[0], out.token_ids)
    assert params[0].logprobs == len(tracked)  # vLLM's num_logprobs
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert set(entry) == {token, *tracked}  # the tracked ones instead of the top ones
        for token_id in tracked:
            assert entry[token_id] == pytest.approx(reference[step, token_id].item(), abs=1e-4)
            assert entry[token_id].rank is None or token_id == token
        assert entry[token] == pytest.approx(reference[step, token].item(), abs=1e-4)
        assert entry[token].rank == 1  # greedy: the most likely

    top_row = outputs[1].outputs[0]
    reference = step_log_softmax(model, prompts[1], top_row.token_ids)
    for step, entry in enumerate(top_row.logprobs):
        assert set(reference[step].topk(3).indices.tolist()) <= set(entry)  # the batch's tracked row changed nothing
    assert outputs[2].outputs[0].logprobs is None
    alone = llm.generate(prompts[:1], SamplingParams(max_tokens=6, temperature=0))[0].outputs[0]
    assert alone.token_ids == out.token_ids  # tracking changes no sample


def test_tracked_tokens_follow_every_sample_of_a_request(llm, model):
    prompt = [3, 1, 4, 1, 5, 9]
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=7, logprob_token_ids=[2, 6])
    out = llm.generate([prompt], params)[0]
    assert len(out.outputs) == 3
    for sample in out.outputs:
        reference = step_log_softmax(model, prompt, sample.token_ids)
        for step, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
            assert set(entry) == {token, 2, 6}
            assert entry[6] == pytest.approx(reference[step, 6].item(), abs=1e-4)


def test_tracked_tokens_outside_the_vocabulary_are_refused_by_name(llm):
    with pytest.raises(ConfigError, match=r"logprob_token_ids=\[256\] are outside the vocabulary: allowed: "
                                          r"token ids in \[0, 256\)"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, logprob_token_ids=[3, 256]))
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # the engine goes on


@pytest.mark.parametrize("kwargs, message", [
    (dict(logprob_token_ids=[]), "logprob_token_ids=[] is invalid; allowed: None or a list of 1 to 128 token ids"),
    (dict(logprob_token_ids=[1, -2]), r"logprob_token_ids=[1, -2] is invalid"),
    (dict(logprob_token_ids=list(range(129))), r"logprob_token_ids=[...] (129 ids) is invalid; allowed: None or "
                                               "a list of 1 to 128"),
    (dict(logprob_token_ids="yes"), "logprob_token_ids='yes' (str) is invalid"),
    (dict(logprob_token_ids=[1, 2], logprobs=5), "logprobs=5 is invalid; allowed: None or len(logprob_token_ids)=2"),
])
def test_bad_tracked_tokens_name_the_parameter(kwargs, message):
    with pytest.raises(ConfigError) as error:
        SamplingParams(**kwargs)
    assert message in str(error.value)


def test_more_tracked_tokens_than_top_logprobs_allow():
    params = SamplingParams(logprob_token_ids=list(range(40)))
    assert params.logprobs == 40  # above the top logprobs' cap of 20, as vLLM allows
    assert params.member(1).logprobs == 40  # a sample's params check again
