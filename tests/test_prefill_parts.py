"""How a step's prefill chunks split into attention calls (runner/prefill_parts.py): the rule, the
parts the runner builds, and the engine's output with every step split (on the CPU, through the
same orchestration the CUDA kernels get: the per-step torch plan switched off)."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ponytail
from ponytail import SamplingParams
from ponytail.runner import prefill_parts
from ponytail.runner.prefill_parts import PartSpan, split_by_context
from ponytail.runner.step_cache import PackedStepCache


@pytest.fixture
def tunables(monkeypatch):
    """The rule's table, restored after the test."""
    monkeypatch.setattr(prefill_parts, "TUNABLES", dict(prefill_parts.TUNABLES))
    return prefill_parts.TUNABLES


def test_chunks_all_without_context_or_all_with_are_one_call(tunables):
    assert split_by_context([(0, 3000), (0, 500)], heads=32, sms=132) == [PartSpan(0, 2, True)]
    assert split_by_context([(100, 3000), (7, 500)], heads=32, sms=132) == [PartSpan(0, 2, False)]
    assert split_by_context([], heads=32, sms=132) == []


def test_a_long_run_without_context_attends_apart_when_the_rest_fills_the_device(tunables):
    # A continued prompt (context 2,000, 700 new: 6 query tiles x 32 heads = 192 CTAs >= 132 SMs)
    # before new prompts of 1,500 tokens in all.
    rows = [(2000, 700), (0, 1000), (0, 300), (0, 200)]
    assert split_by_context(rows, heads=32, sms=132) == [PartSpan(0, 1, False), PartSpan(1, 4, True)]
    # Prefix hits between runs: each run long enough goes apart, the chunks around it stay gathered.
    rows = [(0, 1200), (64, 600), (0, 1100), (128, 900), (0, 20)]
    assert split_by_context(rows, heads=32, sms=132) == [
        PartSpan(0, 1, True), PartSpan(1, 2, False), PartSpan(2, 3, True), PartSpan(3, 5, False)]


def test_no_split_when_it_cannot_pay(tunables):
    # The new prompts hold fewer tokens than own_kv_min_tokens (1,024): their gather is cheaper than a call.
    assert split_by_context([(2000, 700), (0, 1000)], heads=32, sms=132) == [PartSpan(0, 2, False)]
    # The continued prompt alone would leave the device idle: 1 query tile x 32 heads < 132 SMs.
    assert split_by_context([(5000, 100), (0, 4000)], heads=32, sms=132) == [PartSpan(0, 2, False)]
    # ... and with 5 tiles it fills it (5 x 32 = 160).
    assert split_by_context([(5000, 600), (0, 4000)], heads=32, sms=132) == [
        PartSpan(0, 1, False), PartSpan(1, 2, True)]
    # Every call over the blocks must fill it, not their sum: here the second would not.
    rows = [(3000, 700), (0, 2000), (40, 10)]
    assert split_by_context(rows, heads=32, sms=132) == [PartSpan(0, 3, False)]


def test_the_tunables_move_the_thresholds(tunables):
    rows = [(5000, 100), (0, 50)]
    assert split_by_context(rows, heads=32, sms=132) == [PartSpan(0, 2, False)]
    tunables.update(own_kv_min_tokens=50, min_tiles=32)
    assert split_by_context(rows, heads=32, sms=132) == [PartSpan(0, 1, False), PartSpan(1, 2, True)]
    tunables.update(query_tile=64, min_tiles=None)  # 100 tokens = 2 tiles of 64 x 64 heads = 128 < 132
    assert split_by_context(rows, heads=64, sms=132) == [PartSpan(0, 2, False)]


def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=500, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # sharp logits: no near ties for fp32 rounding to flip
    return model


def tiny_llm(model, **kwargs):
    settings = dict(kv_cache_memory="4MiB", block_size=4, max_num_seqs=8, max_model_len=512)
    return ponytail.LLM(model, **{**settings, **kwargs})


def test_the_runner_builds_one_call_per_span(tunables):
    llm = tiny_llm(tiny_model())
    runner = llm.engine.runner
    assert runner.sms is None and runner.heads == 4  # the CPU: one call a step
    rows = [(0, 6), (8, 5), (0, 3), (0, 2)]
    tables = [[1, 2], [3, 4, 5, 6], [7], [8]]
    one = runner._prefill_chunks(rows, tables, start=2)
    assert one.parts is None and one.runs is None and one.num_tokens == 16 and one.num_keys == 24
    runner.sms = 1
    tunables.update(own_kv_min_tokens=5, min_tiles=0)
    step = runner._prefill_chunks(rows, tables, start=2)
    assert [(p.start, p.num_tokens, p.runs is not None) for p in step.parts] == [(2, 6, True), (8, 5, False),
                                                                              (13, 5, True)]
    own, cached, last = step.parts
    assert own.cu_seq_q.tolist() == [0, 6] and own.max_query_len == 6
    assert cached.cu_seq_q.tolist() == [0, 5] and cached.seq_lens.tolist() == [13] and cached.num_keys == 13
    assert cached.block_tables.tolist() == [[3, 4, 5, 6]] and cached.max_query_len == 5
    assert last.cu_seq_q.tolist() == [0, 3, 5] and [(r.start, r.rows, r.length) for r in last.runs] == [
        (0, 1, 3), (3, 1, 2)]
    assert (step.start, step.num_tokens, step.runs, step.num_keys) == (2, 16, None, 24)  # the whole, for the torch plan
    assert step.cu_seq_q.tolist() == [0, 6, 11, 14, 16] and step.cu_seq_q.device.type == "cpu"


def test_split_steps_give_plain_greedy_output(tunables, monkeypatch):
    """Every step that can split does (any run without context, any size), and attention runs each
    call as the CUDA path does (no per-step torch plan): greedy tokens equal plain generate's."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(3, 90))] for _ in range(10)]
    shared = prompts[0][:40]
    prompts += [shared + [rng.randrange(1, 500) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    model = tiny_model()
    expected = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    llm = tiny_llm(model, max_num_batched_tokens=48)  # 48: long prompts continue in the next step
    tunables.update(own_kv_min_tokens=1, min_tiles=0)
    llm.engine.runner.sms = 1
    monkeypatch.setattr(PackedStepCache, "_torch_plan", lambda self, step: None)
    splits = []
    spans = prefill_parts.split_by_context
    monkeypatch.setattr("ponytail.runner.model_runner.split_by_context",
                        lambda *a: (out := spans(*a)) and splits.append(len(out)) or out)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    assert any(n > 1 for n in splits), f"no step split: {splits}"
    assert llm.stats().prefix_cache_hits > 0 and llm.stats().used_blocks == 0
