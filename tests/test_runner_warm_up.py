"""ModelRunner.warm_up: the dummy prompt steps LLM() runs on CUDA so that kernels compiled at first
use (FlashAttention-4, the compiled layers' prompt shapes) compile at start-up. On the CPU the same
steps run through the torch path: they must leave the cache and the engine's results untouched, and
a failure must name the setting that chose the kernel."""

import logging

import pytest
import torch

import ponytail
from ponytail import KernelError, SamplingParams
from ponytail.runner import model_runner

pytestmark = pytest.mark.network  # the default model's tokenizer


def make_llm(small_model, **kwargs):
    model, tokenizer = small_model
    settings = dict(kv_cache_memory="4MiB", block_size=4, max_num_seqs=8, max_model_len=256)
    return ponytail.LLM(model, tokenizer=tokenizer, **{**settings, **kwargs})


GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[11 + i, 200 + 3 * i, 7, 4000 + i, 12] * (2 + i) for i in range(3)]


def test_warm_up_writes_nothing_and_changes_no_output(small_model, caplog):
    before = [o.token_ids for o in make_llm(small_model).generate(PROMPTS, GREEDY)]
    llm = make_llm(small_model)
    runner, cache = llm.engine.runner, llm.engine.cache
    kv_before = [chunk.clone() for chunk in cache.storage.chunks]
    free_before = cache.stats().free_blocks
    calls = []
    forward = runner._forward
    runner._forward = lambda ids, positions, sample_at: calls.append(len(positions)) or forward(ids, positions, sample_at)
    with caplog.at_level(logging.INFO, logger="ponytail.engine"):
        runner.warm_up()
    assert "warm-up over dummy prompt chunks (prompt attention 'flash') in" in caplog.text
    # The largest step first (the scheduler's biggest budget: 128 on the CPU), then every small one (all fit 256).
    assert runner.max_step_tokens == 128
    assert calls == [128] + [sum(n for _, n in rows) for rows in model_runner.WARM_UP_STEPS]
    assert cache.stats().free_blocks == free_before
    for old, new in zip(kv_before, cache.storage.chunks, strict=True):
        assert torch.equal(old.view(torch.uint8), new.view(torch.uint8))  # bitwise: slots -1 write nothing
    assert runner.hf_cache.step is None
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == before


def test_warm_up_skips_steps_longer_than_the_model_length(small_model):
    llm = make_llm(small_model, max_model_len=64)
    calls = []
    forward = llm.engine.runner._forward
    llm.engine.runner._forward = lambda ids, positions, sample_at: calls.append(positions[-1]) or forward(
        ids, positions, sample_at)
    llm.engine.runner.warm_up()
    assert calls and max(calls) < 64
    assert len(calls) == 1 + sum(max(c + n for c, n in rows) <= 64 for rows in model_runner.WARM_UP_STEPS)


def test_the_warm_up_starts_with_the_largest_step_cut_into_prompts_the_model_takes():
    small = [rows for rows in model_runner.WARM_UP_STEPS if max(c + n for c, n in rows) <= 100]
    assert model_runner.warm_up_steps(250, 100) == [((0, 100), (0, 100), (0, 50))] + small
    assert model_runner.warm_up_steps(16384, 32768) == [((0, 16384),), *model_runner.WARM_UP_STEPS]
    assert model_runner.warm_up_steps(0, 256) == list(model_runner.WARM_UP_STEPS)  # no budget given: small ones only


def test_the_engine_warms_up_at_its_largest_budget(small_model):
    llm = make_llm(small_model, max_num_batched_tokens=96, tuning={"prefill_only_batched_tokens": 200})
    assert llm.engine.runner.max_step_tokens == 200


def test_a_warm_up_step_out_of_device_memory_names_the_step_budgets(small_model):
    llm = make_llm(small_model, tuning={"prefill_only_batched_tokens": 200})
    runner = llm.engine.runner
    forward = runner._forward

    def short_of_memory(ids, positions, sample_at):
        if len(positions) == 200:  # the largest step only
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        return forward(ids, positions, sample_at)

    runner._forward = short_of_memory
    with pytest.raises(ponytail.ConfigError) as caught:
        runner.warm_up()
    assert str(caught.value) == (
        "the start-up warm-up step of 200 prompt tokens (the most one step may hold) ran out of device memory: "
        "CUDA out of memory. Tried to allocate 2.00 GiB; lower max_num_batched_tokens / prefill_only_batched_tokens, "
        "or free device memory")
    assert runner.hf_cache.step is None


@pytest.mark.parametrize("varlen, hint", [("fa4", True), ("flash", False)])
def test_a_kernel_failing_at_warm_up_is_a_start_up_error_naming_the_setting(small_model, varlen, hint):
    llm = make_llm(small_model)
    runner = llm.engine.runner

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image for this device")

    runner.hf_cache.prefill_varlen = varlen
    runner.hf_cache.attend = broken
    with pytest.raises(KernelError) as caught:
        runner.warm_up()
    message = str(caught.value)
    assert f"prefill_attention={varlen!r}" in message
    assert "RuntimeError: no kernel image for this device" in message
    assert ("prefill_attention='flash' takes torch's FlashAttention-2 instead" in message) is hint
    assert runner.hf_cache.step is None
