"""The step token budgets (ponytail.config.token_budgets): max_num_batched_tokens while some sequence
decodes, prefill_only_batched_tokens (tuning) for a step of prompt chunks only; their defaults per
device, the checks of what a user sets, and what the scheduler does with them (engine/scheduler.py)."""

import pytest
from scheduled_steps import add, engine_on, own_prompt, run_steps, tiny_llama

import ponytail
from ponytail import ConfigError, SamplingParams
from ponytail.config import EngineConfig, ModelFacts, token_budgets


def test_defaults_per_device():
    assert token_budgets("cuda", 256) == (8192, 16384)
    assert token_budgets("cuda", 12000) == (12000, 16384)  # a step must seat every decoder
    assert token_budgets("cuda", 20000) == (20000, 20000)
    assert token_budgets("cpu", 8) == (128, 128)  # the CPU's keeps streams beside a prompt moving
    assert token_budgets("cpu", 8, prefill_only_batched_tokens=512) == (128, 512)


def test_a_budget_set_by_hand_is_the_ceiling_of_every_step_unless_both_are_set():
    assert token_budgets("cuda", 256, 4096) == (4096, 4096)
    assert token_budgets("cuda", 256, 4096, 32768) == (4096, 32768)
    assert token_budgets("cuda", 256, None, 8192) == (8192, 8192)


@pytest.mark.parametrize("step, prefill_only, message", [
    (4096, 2048, "prefill_only_batched_tokens=2048 must be >= max_num_batched_tokens=4096"),
    (0, None, "max_num_batched_tokens=0 is not supported; allowed: an integer >= 1"),
    (2.5, None, "max_num_batched_tokens=2.5 is not supported; allowed: an integer >= 1"),
    (None, True, "prefill_only_batched_tokens=True is not supported; allowed: an integer >= 1"),
    (64, None, "max_num_batched_tokens=64 must be >= max_num_seqs=256"),
])
def test_bad_budgets_are_refused_by_name(step, prefill_only, message):
    facts = ModelFacts(loaded_here=True, compilable=True, fusable=True, max_position_embeddings=512)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig.from_kwargs(max_num_seqs=256, max_num_batched_tokens=step,
                                 tuning={"prefill_only_batched_tokens": prefill_only}).resolved("cuda", facts)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def test_a_step_without_decode_rows_takes_the_larger_budget(model):
    e = engine_on(model, max_num_batched_tokens=32, tuning={"prefill_only_batched_tokens": 64})
    assert (e.scheduler.max_num_batched_tokens, e.scheduler.prefill_only_batched_tokens) == (32, 64)
    for name in "abc":
        add(e, name, own_prompt(name, 40), 3)
    seen = run_steps(e)
    assert seen[0] == [("a", 40), ("b", 24)]  # nothing decodes: 64 prompt tokens
    assert seen[1] == [("a", 1), ("b", 16), ("c", 15)]  # a decodes: back to 32


def test_with_a_step_in_flight_a_request_it_finishes_does_not_count_as_decoding(model):
    """Prompts with one output token (prompt scoring): the step in flight samples each one's last
    token, so the next step is prompt chunks only and takes the larger budget."""
    e = engine_on(model, max_num_batched_tokens=32, tuning={"prefill_only_batched_tokens": 64},
                  async_scheduling=True)
    for name in "abcd":
        add(e, name, own_prompt(name, 30), 1)
    seen = run_steps(e)
    assert [sum(n for _, n in step) for step in seen] == [64, 56]


def test_the_cpu_default_is_one_budget_and_outputs_do_not_depend_on_it(model):
    e = engine_on(model)
    assert e.scheduler.max_num_batched_tokens == e.scheduler.prefill_only_batched_tokens == 128
    prompts = [list(range(3, 3 + n)) for n in (50, 90, 17, 130)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outputs = []
    for prefill_only in (32, 256):
        llm = ponytail.LLM(model, kv_cache_memory="16MiB", max_num_seqs=4, max_model_len=512,
                           max_num_batched_tokens=32, tuning={"prefill_only_batched_tokens": prefill_only})
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1]


def test_llm_refuses_a_prefill_only_budget_under_the_step_budget(model):
    with pytest.raises(ConfigError, match="prefill_only_batched_tokens=16 must be >= max_num_batched_tokens=32"):
        ponytail.LLM(model, kv_cache_memory="16MiB", max_num_seqs=4, max_num_batched_tokens=32,
                     tuning={"prefill_only_batched_tokens": 16})
