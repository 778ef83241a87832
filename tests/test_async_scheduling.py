"""Async scheduling on the CPU: step N+1 is launched before step N's tokens are read back, and
everything users see (tokens, text, finish reasons, logprobs, prefix hits) equals the
synchronous engine. On the CPU the forward pass runs at launch, so nothing overlaps, but the
placeholders, the device-side input gather, the deferred prefix commits and the fallbacks run
exactly as on a GPU."""

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine import make_llm, plain_greedy, random_prompts, walked_promised_blocks

import ponytail
from ponytail import ConfigError, SamplingParams
from ponytail.sampling.sampler import HostSamples

pytestmark = pytest.mark.network  # the default model's tokenizer


class Logprobs:
    """A sample's logprobs, equal to another's when the same tokens carry the same values within
    float32 rounding: on a multi-threaded CPU the batched GEMMs may split a row's sums differently
    beside other neighbours (last-place differences, seen on a 2-thread AMD EPYC), which is what
    the async engine's batches change. Tokens, text and finish reasons stay compared exactly."""

    def __init__(self, entries):
        self.entries = entries

    def __eq__(self, other) -> bool:
        if not isinstance(other, Logprobs) or (self.entries is None) != (other.entries is None):
            return False
        if self.entries is None:
            return True
        return len(self.entries) == len(other.entries) and all(
            a.keys() == b.keys() and all(math.isclose(a[t], b[t], rel_tol=1e-5, abs_tol=1e-6) for t in a)
            for a, b in zip(self.entries, other.entries))

    def __repr__(self) -> str:
        return f"Logprobs({self.entries!r})"


def summary(outputs):
    """What a user sees of each output."""
    return [(o.token_ids, o.text, o.finish_reason, o.outputs[0].stop_reason, Logprobs(o.outputs[0].logprobs))
            for o in outputs]


def both_modes(small_model, prompts, params, **kwargs):
    """(sync outputs, async outputs, async LLM) of the same prompts on two fresh engines."""
    results = []
    for mode in (False, True):
        llm = make_llm(small_model, async_scheduling=mode, **kwargs)
        results.append((llm.generate(prompts, params), llm))
    (sync_out, _), (async_out, async_llm) = results
    engine = async_llm.engine
    assert engine.async_scheduling and not engine.has_unfinished()
    assert engine.stats().used_blocks == 0 and engine.cache.invariants() == []
    return sync_out, async_out, async_llm


def record_launches_and_syncs(monkeypatch, engine) -> list[str]:
    """Log "launch" (a forward pass queued) and "sync" (a step's samples read back), in order."""
    events = []
    execute, wait = engine.runner.execute, HostSamples.wait

    def logged_execute(*args, **kwargs):
        events.append("launch")
        return execute(*args, **kwargs)

    def logged_wait(self):
        events.append("sync")
        return wait(self)

    monkeypatch.setattr(engine.runner, "execute", logged_execute)
    monkeypatch.setattr(HostSamples, "wait", logged_wait)
    return events


def test_greedy_outputs_equal_the_sync_engine_and_plain_generate(small_model):
    prompts = random_prompts(10)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    sync_out, async_out, _ = both_modes(small_model, prompts, params)
    assert summary(async_out) == summary(sync_out)
    for prompt, output in zip(prompts, async_out):
        assert output.token_ids == plain_greedy(small_model[0], prompt, 12)
        assert len(output.outputs[0].logprobs) == 12


def test_each_step_is_launched_before_the_previous_one_is_read_back(small_model, monkeypatch):
    llm = make_llm(small_model, async_scheduling=True)
    engine = llm.engine
    events = record_launches_and_syncs(monkeypatch, engine)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for prompt in random_prompts(3, seed=2):
        engine.add_request(prompt, params)
    assert engine.step() == [] and engine.has_unfinished()  # step 0 runs; nothing read back yet
    assert events == ["launch"]
    steps = 1
    while engine.has_unfinished():
        engine.step()
        steps += 1
    # 6 launches (prefill + 5 decodes: the 6th token finishes by length, so nothing is scheduled
    # after it); each later step is launched before its predecessor is read back.
    assert events == ["launch"] + ["launch", "sync"] * 5 + ["sync"]
    assert steps == 7 and engine.stats().used_blocks == 0


def test_sync_mode_reads_every_step_back_before_the_next(small_model, monkeypatch):
    llm = make_llm(small_model, async_scheduling=False)
    events = record_launches_and_syncs(monkeypatch, llm.engine)
    llm.generate(random_prompts(3, seed=2), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert events == ["launch", "sync"] * 6


def test_stop_tokens_eos_and_stop_strings_mid_batch_equal_the_sync_engine(small_model):
    prompts = random_prompts(12, seed=4)
    full = make_llm(small_model).generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    rng = random.Random(4)
    counts = {}
    for output in full:
        for token in output.token_ids[2:]:
            counts[token] = counts.get(token, 0) + 1
    eos = max(counts, key=counts.get)  # a token several prompts reach: "EOS" ends them mid-batch
    params = []
    for i, output in enumerate(full):
        kind = i % 3
        if kind == 0:  # a stop token taken from the prompt's own greedy output
            params.append(SamplingParams(max_tokens=16, temperature=0, logprobs=1,
                                         stop_token_ids=[output.token_ids[rng.randrange(1, 12)]]))
        elif kind == 1 and len(output.text.strip()) >= 6:  # a stop string from its own text
            cut = rng.randrange(len(output.text) // 3, len(output.text) - 1)
            params.append(SamplingParams(max_tokens=16, temperature=0, stop=[output.text[cut : cut + 2]]))
        else:
            params.append(SamplingParams(max_tokens=16, temperature=0, min_tokens=2))
    results = []
    for mode in (False, True):
        llm = make_llm(small_model, async_scheduling=mode)
        llm.engine.eos_token_ids = frozenset([eos])
        results.append(summary(llm.generate(prompts, params)))
        assert llm.stats().used_blocks == 0 and llm.engine.cache.invariants() == []
    assert results[1] == results[0]
    reasons = [r[2] for r in results[1]]
    assert reasons.count("stop") >= 4 and "length" in reasons  # some stopped early, mid-batch
    for (tokens, *_), output, p in zip(results[1], full, params):
        assert tokens == output.token_ids[: len(tokens)]  # no extra tokens, nothing skipped


def test_preemption_under_a_small_budget_keeps_outputs(small_model, monkeypatch):
    # 64 blocks of 4 tokens for 8 sequences growing to ~70 tokens: preemption is certain.
    budget = dict(kv_cache_memory=64 * 4 * 2 * 2 * 2 * 16 * 4, max_num_batched_tokens=64)
    prompts = random_prompts(8, seed=1, low=20, high=40)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    sync_out, async_out, llm = both_modes(small_model, prompts, params, **budget)
    assert llm.stats().num_preemptions > 0
    assert summary(async_out) == summary(sync_out)
    for prompt, output in zip(prompts, async_out):
        assert output.token_ids == plain_greedy(small_model[0], prompt, 40)


def test_seeded_sampling_equals_the_sync_engine(small_model):
    prompts = random_prompts(6, seed=7)
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=100 + i, logprobs=3)
              for i in range(6)]
    sync_out, async_out, _ = both_modes(small_model, prompts, params)
    assert summary(async_out) == summary(sync_out)


def test_penalties_fall_back_to_sync_steps_and_keep_outputs(small_model, monkeypatch):
    prompts = random_prompts(4, seed=12)
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 3
    params.append(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                                 frequency_penalty=0.5))
    sync_out, async_out, _ = both_modes(small_model, prompts, params)
    assert summary(async_out) == summary(sync_out)
    llm = make_llm(small_model, async_scheduling=True)
    events = record_launches_and_syncs(monkeypatch, llm.engine)
    llm.generate(prompts, params)
    # The penalized request is in every step: each is read back before the next is built.
    assert events == ["launch", "sync"] * 8


def test_prefix_cache_hits_equal_the_sync_engine(small_model):
    prefix = random_prompts(1, seed=5, low=32, high=32)[0]
    prompts = random_prompts(8, seed=6, low=2, high=9, shared_prefix=prefix)
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    stats = []
    for mode in (False, True):
        llm = make_llm(small_model, async_scheduling=mode)
        outputs = [llm.generate(prompts[:1], params), llm.generate(prompts[1:5], params),
                   llm.generate(prompts[5:], params)]
        # A prompt that is an earlier prompt plus its output hits the blocks its decode filled.
        again = llm.generate([prompts[1] + outputs[1][0].token_ids + [5]], params)
        stats.append((llm.stats().prefix_cache_hits, llm.stats().prefix_cache_queries,
                      [summary(o) for o in outputs + [again]]))
        assert llm.engine.cache.invariants() == []
    assert stats[1] == stats[0]
    assert stats[1][0] >= 7 * 32 + 40  # the shared prefix, and the blocks prompt 1's decode filled


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), abort_rate=st.sampled_from([0.05, 0.2, 0.5]))
def test_hundreds_of_requests_with_random_aborts_leave_no_blocks_behind(small_model, seed, abort_rate):
    llm = make_llm(small_model, max_num_seqs=16, async_scheduling=True)
    engine = llm.engine
    rng = random.Random(seed)
    prompts = random_prompts(200, seed=seed, low=1, high=30)
    params = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=0, ignore_eos=True,
                             stop_token_ids=[rng.randrange(10, 49152)] if rng.random() < 0.3 else None)
              for _ in prompts]
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    aborted_at: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert -1 not in out.new_token_ids
        assert engine.stats().promised_blocks == walked_promised_blocks(engine)
        steps += 1
        for request in rng.sample(requests, 3):
            if rng.random() < abort_rate and engine.abort(request.request_id):
                aborted_at[request.request_id] = len(engine.output(request).token_ids)
        assert engine.stats().promised_blocks == walked_promised_blocks(engine)
        for request in rng.sample(requests, 5):
            assert -1 not in engine.output(request).token_ids
        if steps % 10 == 0:
            assert engine.cache.invariants() == []
    assert all(r.finished for r in requests) and aborted_at
    assert engine.stats().used_blocks == 0 and engine.cache.invariants() == []
    # Finished requests equal the sync engine; aborted ones are a prefix of it, cut where aborted.
    expected = make_llm(small_model, max_num_seqs=16).generate(prompts, params)
    for request, want in zip(requests, expected):
        got = engine.output(request)
        if request.request_id in aborted_at:
            assert got.finish_reason == "abort" and len(got.token_ids) == aborted_at[request.request_id]
            assert got.token_ids == want.token_ids[: len(got.token_ids)]
        else:
            assert summary([got]) == summary([want])


def test_default_model_text_with_eos_equals_the_sync_engine(default_model):
    model, tokenizer = default_model
    messages = ["What is the capital of France?", "Name three colors.", "Say hi.", "Count to five."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                             add_generation_prompt=True) for m in messages]
    params = SamplingParams(max_tokens=40, temperature=0)
    results = []
    original = model.config._attn_implementation  # the session's shared model: LLM switches it
    try:
        for mode in (False, True):
            llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="64MiB", max_num_seqs=4,
                               max_model_len=256, async_scheduling=mode)
            results.append(summary(llm.generate(prompts, params)))
            assert llm.stats().used_blocks == 0
    finally:
        model.set_attn_implementation(original)
    assert results[1] == results[0]
    assert any(r[2] == "stop" for r in results[1])  # EOS ended some answers before max_tokens


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_async_scheduling_must_be_a_bool_or_none(small_model, value):
    with pytest.raises(ConfigError, match=f"async_scheduling={value!r} is not supported; allowed: True, False or None"):
        make_llm(small_model, async_scheduling=value)


def test_async_scheduling_defaults_to_off_on_the_cpu(small_model):
    assert not make_llm(small_model).engine.async_scheduling
    assert torch.device("cpu") == next(small_model[0].parameters()).device


class _NoEvent:
    def record(self):
        pass

    def synchronize(self):
        pass


def eager_decode_graphs(monkeypatch, llm):
    """DecodeGraphs on the CPU, each "replay" running the forward pass eagerly: run()'s staging
    into the static buffers and the device-side input fill, exactly as on a GPU."""
    from ponytail.runner.cuda_graphs import DecodeGraphs, _Captured

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(torch.cuda, "Event", _NoEvent)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.hf_cache, 8, 64)

    class EagerReplay:
        def __init__(self, size, logits):
            self.size, self.logits = size, logits

        def replay(self):
            runner.hf_cache.step = graphs._step(self.size)
            self.logits.copy_(graphs._forward(self.size))

    def capture(size):
        vocab = runner.model.config.vocab_size
        logits = torch.empty((1, size, vocab))
        graphs._graphs[size] = _Captured(EagerReplay(size, logits), logits)

    monkeypatch.setattr(graphs, "_capture", capture)
    runner.graphs = graphs
    return graphs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_decode_graph_path_takes_its_inputs_from_the_previous_step(small_model, monkeypatch,
                                                                        async_scheduling):
    llm = make_llm(small_model, async_scheduling=async_scheduling)
    graphs = eager_decode_graphs(monkeypatch, llm)
    import ponytail.runner.cuda_graphs as cuda_graphs

    filled, fill = [], cuda_graphs.fill_inputs
    monkeypatch.setattr(cuda_graphs, "fill_inputs", lambda ids, sampled, index: (
        filled.append(index.shape[1]), fill(ids, sampled, index)))
    prompts = random_prompts(6, seed=13)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert graphs.replays > 0
    assert filled == ([6] * 9 if async_scheduling else [])  # 9 decode steps, every row from the device
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == plain_greedy(small_model[0], prompt, 10)
    assert llm.stats().used_blocks == 0


def test_nan_logits_stop_one_request_mid_batch_like_the_sync_engine(small_model, monkeypatch):
    prompts = random_prompts(4, seed=14)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    results = []
    for mode in (False, True):
        llm = make_llm(small_model, async_scheduling=mode)
        execute = llm.engine.runner.execute

        def poisoned(chunks, *args):
            logits = execute(chunks, *args).clone()
            for row, chunk in enumerate(c for c in chunks if c.samples):
                request = chunk.request
                if request.request_id == "1" and request.num_tokens == len(request.prompt_token_ids) + 4:
                    logits[row] = float("nan")  # the 5th token of request 1
            return logits

        monkeypatch.setattr(llm.engine.runner, "execute", poisoned)
        outputs = llm.generate(prompts, params)
        results.append(summary(outputs) + [[o.error for o in outputs]])
        assert llm.stats().used_blocks == 0 and llm.engine.cache.invariants() == []
    assert results[1] == results[0]
    tokens, _, reason, *_ = results[1][1]
    assert len(tokens) == 4 and reason == "error" and "NaN" in results[1][-1][1]
    assert [len(r[0]) for r in results[1][:4]] == [10, 4, 10, 10]
