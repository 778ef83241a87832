"""Context-aware chunk sizes (engine/chunk_cost.py): a prefill chunk's share of a step's budget
counts its attention over cached context, decode rows count one token each."""

import pytest
from hypothesis import example, given, settings, strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import ponytail
from ponytail import ConfigError, SamplingParams
from ponytail.engine.chunk_cost import chunk_cost, chunk_tokens, context_cost


def test_context_cost_of_the_default_model_shape():
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         num_hidden_layers=30)
    # q/o 576x576 each, k/v 576x192 each, gate/up/down 576x1536: 3,538,944 per token;
    # QK^T and PV: 2 x 9 heads x 64 per cached token.
    assert context_cost(config) == 1152 / 3_538_944 == 1 / 3072


def test_chunk_cost_counts_the_mean_context_of_the_chunk():
    assert chunk_cost(100, 0, 0.0) == 100
    assert chunk_cost(100, 0, 1 / 100) == 150  # 100 x (1 + 50/100)
    assert chunk_cost(100, 1000, 1 / 100) == 1150  # 100 x (1 + 1050/100)


@settings(max_examples=300, deadline=None)
@given(want=st.integers(1, 5000), start=st.integers(0, 100_000), budget=st.integers(1, 8192),
       cost=st.sampled_from([0.0, 1 / 3072, 1 / 500, 1 / 24_576, 0.5]))
@example(want=2048, start=8192, budget=8192, cost=1 / 3072)  # an exact fit the closed form's sqrt rounded under
def test_chunk_tokens_is_the_largest_chunk_within_the_budget(want, start, budget, cost):
    n = chunk_tokens(want, start, budget, cost)
    assert 1 <= n <= want
    if n > 1:
        assert chunk_cost(n, start, cost) <= budget
    if n < want:  # one more token would not fit
        assert chunk_cost(n + 1, start, cost) > budget


def test_a_chunk_moves_on_even_when_one_token_costs_more_than_the_budget():
    assert chunk_tokens(500, 10_000_000, 4, 1 / 3072) == 1
    assert chunk_tokens(500, 0, 0, 1 / 3072) == 0


def recording(scheduler):
    """Every SchedulerOutput the engine's steps get, in order."""
    seen, schedule = [], scheduler.schedule

    def wrapped(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if out is not None:
            seen.append(out)
        return out

    scheduler.schedule = wrapped
    return seen


def test_the_last_chunks_of_a_long_prompt_are_smaller_and_decode_rows_all_run(tiny_model):
    model, tokenizer = tiny_model
    llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="16MiB", max_num_seqs=8, max_model_len=1600,
                       max_num_batched_tokens=64)
    engine = llm.engine
    cost = engine.scheduler.context_cost
    assert cost == context_cost(model.config) > 0  # on by default on the CPU
    for i in range(4):
        engine.add_request([10 + i] * 5, SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
    engine.step()  # the four short prompts prefill; from now on they decode
    long = engine.add_request(list(range(100, 1600)), SamplingParams(max_tokens=1))
    seen = recording(engine.scheduler)
    while not long.finished:
        engine.step()
    sizes = []
    for out in seen:
        chunk = [c for c in out.chunks if c.request is long]
        decode = [c for c in out.chunks if c.request is not long]
        assert len(decode) == 4 and all(c.num_tokens == 1 for c in decode)  # every stream, every step
        if chunk:
            n, start = chunk[0].num_tokens, chunk[0].start
            assert chunk_cost(n, start, cost) <= 64 - 4  # the budget less the decode rows
            sizes.append(n)
    assert sum(sizes) == 1500
    assert sizes[0] == chunk_tokens(1500, 0, 60, cost) and sizes[-2] < sizes[0]
    assert sizes[:-1] == sorted(sizes[:-1], reverse=True)  # the last one is what was left


def test_context_aware_chunks_off_counts_tokens_only(tiny_model):
    model, tokenizer = tiny_model
    llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="16MiB", max_num_seqs=8, max_model_len=1600,
                       max_num_batched_tokens=64, tuning={"context_aware_chunks": False})
    assert llm.engine.scheduler.context_cost == 0
    long = llm.engine.add_request(list(range(100, 1600)), SamplingParams(max_tokens=1))
    seen = recording(llm.engine.scheduler)
    while not long.finished:
        llm.engine.step()
    assert [c.num_tokens for out in seen for c in out.chunks] == [64] * 23 + [28]


def test_context_aware_chunks_is_checked(tiny_model):
    model, tokenizer = tiny_model
    with pytest.raises(ConfigError, match=r"context_aware_chunks='yes' is not supported; allowed: True, False or "
                                          r"None \(the device's default\)"):
        ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="4MiB", tuning={"context_aware_chunks": "yes"})


def test_the_cpu_default_budget_is_128_tokens(tiny_model):
    model, tokenizer = tiny_model
    llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="4MiB", max_num_seqs=16, max_model_len=256)
    assert llm.engine.scheduler.max_num_batched_tokens == 128
