"""The engine reuses a step's sampling batch while its rows and their settings cannot have changed:
the same tokens as rebuilding it every step, through finishing rows, seeds, penalties, min_tokens."""

import pytest

from ponytail import SamplingParams
from ponytail.sampling.sampler import SamplingBatch

from test_engine import make_llm, random_prompts

pytestmark = pytest.mark.network  # the default model's tokenizer


def mixed_params() -> list[SamplingParams]:
    """Greedy and seeded rows of different lengths (rows finish at different steps)."""
    sampled = [{"temperature": 0.8, "top_p": 0.9, "seed": 100 + i} for i in range(6)]
    return [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, **({"temperature": 0} if i % 3 == 0 else sampled[i]))
            for i in range(6)]


def run(small_model, params, rebuild: bool, monkeypatch, **engine):
    """(token ids per request, batches built, batches reused)."""
    with monkeypatch.context() as patch:
        if rebuild:  # every batch looks step-dependent: built anew each step, as before reuse
            patch.setattr(SamplingBatch, "changes_per_step", property(lambda self: True))
        llm = make_llm(small_model, **engine)
        outputs = llm.generate(random_prompts(len(params), seed=3), params)
        batches = llm.engine._batches
        return [o.token_ids for o in outputs], batches.num_built, batches.num_reused


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_reused_batches_sample_what_rebuilt_ones_do(small_model, monkeypatch, async_scheduling):
    params = mixed_params()
    reused, built, kept = run(small_model, params, False, monkeypatch, async_scheduling=async_scheduling)
    rebuilt, built_each_step, none_kept = run(small_model, params, True, monkeypatch,
                                              async_scheduling=async_scheduling)
    assert reused == rebuilt
    assert [len(t) for t in reused] == [p.max_tokens for p in params]
    assert none_kept == 0 and kept > 0
    # A batch is built when the rows change (prefill, a row finishing) and reused in between.
    assert built + kept == built_each_step
    assert built <= len(params) + 3


def test_batches_that_change_per_step_are_built_every_step(small_model, monkeypatch):
    penalized = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, presence_penalty=0.5)] * 3
    _, built, kept = run(small_model, penalized, False, monkeypatch)
    assert kept == 0 and built >= 8
    # min_tokens: rebuilt while a row is short of it (its stop tokens masked), reused after.
    short = [SamplingParams(max_tokens=12, min_tokens=5, temperature=0), SamplingParams(max_tokens=12, temperature=0)]
    tokens, built, kept = run(small_model, short, False, monkeypatch)
    tokens_each_step, _, _ = run(small_model, short, True, monkeypatch)
    assert tokens == tokens_each_step
    assert built >= 5 and kept > 0
