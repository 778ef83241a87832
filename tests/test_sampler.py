"""The sampler on the CPU: greedy, filters, penalties, seeds, distributions, bad rows, logprobs."""

import math

import pytest
import torch

import ponytail

from ponytail.sampling.draws import apply_filters
from ponytail.sampling.sampler import (
    SamplingBatch,
    apply_penalties,
    request_generator,
    sample,
)
from ponytail.sampling.params import SamplingParams as SP

CPU = torch.device("cpu")


def batch_of(params, outputs=None, prompts=None, generators=None, eos=None):
    rows = len(params)
    if generators is None:
        generators = [request_generator(p, CPU) for p in params]
    return SamplingBatch.build(params, outputs or [[] for _ in range(rows)],
                               prompts or [[] for _ in range(rows)], generators, CPU,
                               eos_token_id=eos)


def distinct_logits(rows, vocab, seed=0):
    """Random logits whose values differ by at least 0.1, so every argmax is clear."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=g) for _ in range(rows)]).float() * 0.1


def test_greedy_is_argmax_and_skips_everything_else():
    logits = distinct_logits(6, 50)
    batch = batch_of([SP(temperature=0), SP(top_k=1), SP(temperature=0, top_p=0.5, min_p=0.3)] * 2)
    assert batch.all_greedy and batch.temperature is None
    assert batch.top_k is batch.top_p is batch.min_p is batch.output_tokens is None
    assert torch.equal(sample(logits, batch).token_ids, logits.argmax(-1))


def test_greedy_rows_mixed_with_sampled_rows():
    logits = distinct_logits(4, 50)
    batch = batch_of([SP(temperature=0), SP(temperature=5.0), SP(top_k=1), SP()])
    assert batch.greedy.tolist() == [True, False, True, False]
    out = sample(logits, batch).token_ids
    assert out.dtype == torch.int64 and out.shape == (4,)
    assert out[[0, 2]].tolist() == logits.argmax(-1)[[0, 2]].tolist()


def test_temperature_near_zero_is_the_argmax():
    logits = distinct_logits(64, 100)
    batch = batch_of([SP(temperature=1e-3)] * 64)
    assert not batch.all_greedy
    assert torch.equal(sample(logits, batch).token_ids, logits.argmax(-1))


def test_top_k_one_filter_leaves_only_the_top_token():
    logits = distinct_logits(3, 20)
    batch = batch_of([SP(top_k=2)] * 3)
    batch.top_k = torch.tensor([1, 1, 0])  # the filter itself; SamplingParams makes top_k=1 greedy
    batch.max_top_k = 1
    x = logits.clone()
    apply_filters(x, batch)
    assert torch.equal(x[:2].argmax(-1), logits[:2].argmax(-1))
    assert torch.isfinite(x[:2]).sum().item() == 2
    assert torch.equal(x[2], logits[2])  # top_k=0 is off


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.999}], ids=["topk-only", "sorted"])
def test_top_k_samples_only_the_k_best(extra):
    logits = torch.zeros(2000, 10)  # uniform: the filter alone decides
    logits[:, 7] = logits[:, 2] = logits[:, 5] = 0.5
    out = sample(logits, batch_of([SP(top_k=3, **extra)] * 2000)).token_ids
    assert set(out.tolist()) == {2, 5, 7}


def test_top_p_tiny_keeps_only_the_top_token():
    logits = torch.randn(200, 30, generator=torch.Generator().manual_seed(1))
    out = sample(logits, batch_of([SP(top_p=1e-6)] * 200)).token_ids
    assert torch.equal(out, logits.argmax(-1))


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([[0.6, 0.3, 0.1], [0.6, 0.3, 0.1]]).log()
    batch = batch_of([SP(top_p=0.7), SP(top_p=0.95)])
    x = logits.clone()
    apply_filters(x, batch)
    assert torch.isfinite(x).tolist() == [[True, True, False], [True, True, True]]


def test_min_p_drops_tokens_below_min_p_times_the_top():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(3000, 1)
    batch = batch_of([SP(min_p=0.2)] * 3000)  # keeps p >= 0.1
    x = logits[:1].clone()
    apply_filters(x, batch_of([SP(min_p=0.2)]))
    assert torch.isfinite(x).tolist() == [[True, True, True, False]]
    counts = torch.bincount(sample(logits, batch).token_ids, minlength=4)
    assert counts[3] == 0 and counts[2] > 0


def test_penalties_follow_the_formula():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [SP(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25), SP()]
    batch = batch_of(params, outputs=[[1, 2, 2], [1, 2]], prompts=[[0, 4], [0]])
    x = logits.clone()
    apply_penalties(x, batch)
    expected = [
        2.0 / 2,  # prompt only: positive logit divided; no presence/frequency on prompts
        -1.0 * 2 - 0.25 * 1 - 0.5,  # output once: negative multiplied, then OpenAI penalties
        0.5 / 2 - 0.25 * 2 - 0.5,  # output twice
        3.0,  # unseen
        -2.0 * 2,  # prompt only, negative
    ]
    assert x[0].tolist() == pytest.approx(expected)
    assert torch.equal(x[1], logits[1])  # neutral row untouched


def test_neutral_penalties_build_nothing():
    batch = batch_of([SP(), SP(temperature=0)], outputs=[[1, 2], [3]], prompts=[[4], [5]])
    assert batch.output_tokens is batch.prompt_tokens is batch.repetition_penalty is None
    only_presence = batch_of([SP(presence_penalty=1.0)], outputs=[[1]], prompts=[[4]])
    assert only_presence.prompt_tokens is None and only_presence.output_tokens is not None


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 3)
    params = [SP(temperature=0, min_tokens=2, stop_token_ids=[1]),
              SP(temperature=0, min_tokens=2, ignore_eos=True),
              SP(temperature=0, min_tokens=1)]
    out = sample(logits, batch_of(params, outputs=[[3], [3], [3]], eos=0)).token_ids
    assert out.tolist() == [2, 0, 0]  # row 0 still short: EOS (0) and 1 masked; row 2 is done
    several = sample(logits[:1], batch_of(params[:1], outputs=[[3]], eos={0, 2})).token_ids
    assert several.tolist() == [3]  # every EOS id is masked


def run_seeded(rows, steps, target):
    """Tokens of row `target` over several steps of a batch of `rows` (fresh generators)."""
    generators = [request_generator(p, CPU) for p in rows]
    tokens = []
    for step in range(steps):
        logits = torch.randn(len(rows), 300, generator=torch.Generator().manual_seed(step))
        mine = torch.randn(300, generator=torch.Generator().manual_seed(1000 + step))
        logits[target] = mine * 3
        batch = batch_of(rows, generators=generators)
        tokens.append(sample(logits, batch).token_ids[target].item())
    return tokens


def test_seeded_rows_reproduce_whatever_else_is_in_the_batch():
    me = SP(seed=1234, top_k=50, top_p=0.9, temperature=0.8)
    alone = run_seeded([me], 12, 0)
    assert alone == run_seeded([me], 12, 0)
    crowd = [SP(), SP(seed=7), SP(temperature=0), me, SP(min_p=0.1, repetition_penalty=1.2)]
    assert run_seeded(crowd, 12, 3) == alone
    assert run_seeded([SP(seed=99, top_p=0.5), me, SP()][::-1], 12, 1) == alone
    assert run_seeded([SP(seed=1235, top_k=50, top_p=0.9, temperature=0.8)], 12, 0) != alone


def test_seed_without_generator_is_refused():
    with pytest.raises(ValueError, match="row 1 has seed=3 but no generator"):
        batch_of([SP(), SP(seed=3)], generators=[None, None])


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return (((counts - expected) ** 2) / expected).sum().item()


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_unseeded_sampling_matches_the_softmax(temperature):
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0])
    n = 40_000
    out = sample(logits.repeat(n, 1), batch_of([SP(temperature=temperature)] * n)).token_ids
    counts = torch.bincount(out, minlength=6).float()
    # 5 degrees of freedom: P(chi2 > 25) is about 1e-4.
    assert chi_square(counts, (logits / temperature).softmax(-1)) < 25


def test_seeded_sampling_matches_the_softmax():
    logits = torch.tensor([[0.3, -0.2, 1.1, 0.0]])
    params = SP(seed=5)
    batch = batch_of([params], generators=[request_generator(params, CPU)])
    tokens = torch.stack([sample(logits, batch).token_ids[0] for _ in range(4000)])
    assert chi_square(torch.bincount(tokens, minlength=4).float(), logits[0].softmax(-1)) < 25


def test_bad_rows_are_flagged_and_the_rest_still_sample():
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, nan, 1.0], [0.0, inf, 1.0],
                           [-inf, -inf, -inf], [-inf, 3.0, -inf]])
    for params in (SP(temperature=0), SP(), SP(top_p=0.9, min_p=0.1)):
        out = sample(logits, batch_of([params] * 5))
        assert out.bad_rows.tolist() == [False, True, True, True, False]
        assert out.token_ids[4] == 1


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    before = logits.clone()
    params = [SP(logprobs=3, temperature=0.3, repetition_penalty=1.5), SP(logprobs=0),
              SP(temperature=0), SP(logprobs=5, top_k=4)]
    out = sample(logits, batch_of(params, outputs=[[1, 2]] * 4, prompts=[[3]] * 4))
    assert torch.equal(logits, before)  # the input is not modified
    raw = logits.float().log_softmax(-1)
    chosen = raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs, chosen)
    values, ids = out.top_logprobs
    assert values.shape == ids.shape == (4, 5)
    torch.testing.assert_close(values, raw.topk(5, -1).values)
    torch.testing.assert_close(raw.gather(1, ids), values)
    assert sample(logits, batch_of([SP()] * 4)).top_logprobs is None


def test_logprobs_are_computed_only_when_a_row_asks_and_a_plain_greedy_batch_copies_nothing():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    plain = batch_of([SP(temperature=0)] * 3)
    assert not plain.writes_logits
    out = sample(logits, plain)
    assert out.logprobs is None and out.top_logprobs is None
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert batch_of([SP(temperature=0, logit_bias={1: 5.0})] * 3).writes_logits
    assert batch_of([SP(temperature=0, min_tokens=2)] * 3, outputs=[[]] * 3, eos=7).writes_logits
    assert batch_of([SP(temperature=0, presence_penalty=0.5)] * 3, outputs=[[1]] * 3).writes_logits
    assert batch_of([SP(), SP(temperature=0), SP()]).writes_logits


def test_token_ids_outside_the_vocabulary_are_refused():
    batch = batch_of([SP(frequency_penalty=1.0, logprobs=0)], outputs=[[50]])
    with pytest.raises(ValueError, match="token id 50 is outside the vocabulary of 10"):
        sample(torch.zeros(1, 10), batch)
    assert math.isclose(sample(torch.zeros(1, 51), batch).logprobs.item(), -math.log(51),
                        rel_tol=1e-5)


def test_logit_bias_adds_to_the_raw_logits_before_penalties():
    logits = torch.zeros(3, 8)
    logits[:, 2] = 5.0
    params = [SP(temperature=0, logit_bias={6: 10.0}), SP(temperature=0, logit_bias={2: -100}),
              SP(temperature=0)]
    tokens = sample(logits, batch_of(params)).token_ids.tolist()
    assert tokens == [6, 0, 2]  # pushed up; pushed down (ties go to the first index); untouched
    assert logits[0, 6] == 0  # the caller's logits are not modified


@pytest.mark.parametrize("bias", [{-1: 1.0}, {3: 101}, {"3": 1.0}, [3], {3: True}])
def test_bad_logit_bias_names_the_field(bias):
    with pytest.raises(ponytail.ConfigError, match=r"^logit_bias=.* is invalid; allowed: None or a dict of token ids"):
        SP(logit_bias=bias)


def test_greedy_ties_take_the_first_largest_token_as_argmax_does():
    logits = torch.zeros(2, 6)
    logits[0, [2, 4]] = 3.0
    logits[1, [0, 5]] = -1.0
    logits[1, 1:5] = -2.0
    out = sample(logits, batch_of([SP(temperature=0)] * 2))
    assert out.token_ids.tolist() == [2, 0] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("seed", range(4))
def test_cpu_top_p_from_candidates_keeps_what_the_full_sort_keeps(seed, monkeypatch):
    from ponytail.sampling import draws

    monkeypatch.setattr(draws, "TOP_P_CANDIDATES", 64)  # small, so some rows need the full sort
    g = torch.Generator().manual_seed(seed)
    vocab = 500
    peaky = -2.0 * (torch.stack([torch.randperm(vocab, generator=g) for _ in range(6)]) + 1).float().log()
    flat = torch.randn(4, vocab, generator=g) * 0.3  # nucleus far wider than 64 tokens
    logits = torch.cat([peaky, flat])
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.99, 0.2, 1e-6, 0.9, 0.95, 0.5, 0.99])
    top_k = torch.tensor([0, 0, 10, 0, 3, 0, 0, 100, 0, 7])
    expected = logits.clone()
    draws.top_k_top_p_sorted(expected, top_k, top_p)
    params = [SP(temperature=1.0, top_p=float(p), top_k=int(k)) for p, k in zip(top_p, top_k)]
    got = logits.clone()
    draws.apply_filters(got, batch_of(params))
    assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
    assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(got)])  # kept logits are untouched
    assert torch.isfinite(got).sum(-1).min() >= 1
