"""Attention of first chunks over their own K/V (chunk_attention.py) against a naive fp64 reference.

Inputs are laid out as the engine gets them from a stock model: query and key [1, H, N, D]
contiguous (after rotary), value a transposed view of the projection [1, N, Hkv, D]. The GPU tests
(marked gpu) run both device paths: SDPA per run of equal lengths, and flash varlen when the runs
are too many.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ponytail.attention import chunks as chunk_attention
from ponytail.attention.chunks import ChunkRun, SdpaShapes, attention_over_new_tokens, equal_length_runs


def engine_layout(lengths, heads, kv_heads, head_dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    query = torch.randn(1, heads, n, head_dim, generator=gen).to(device, dtype)
    key = torch.randn(1, kv_heads, n, head_dim, generator=gen).to(device, dtype)
    value = torch.randn(1, n, kv_heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=torch.int32, device=device)
    return query[0], key[0], value[0], cu


def naive(query, key, value, lengths, scale, window=None) -> torch.Tensor:
    """Each chunk causal over itself (within `window` positions), fp64, explicit softmax -> [N, Hq, D]."""
    group = query.shape[0] // key.shape[0]
    q, k, v = (t.double().cpu() for t in (query, key, value))
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    out, start = [], 0
    for length in lengths:
        s = slice(start, start + length)
        scores = torch.einsum("hqd,hkd->hqk", q[:, s], k[:, s]) * scale
        hidden = torch.ones(length, length, dtype=torch.bool).triu(1)
        if window is not None:
            hidden |= torch.ones(length, length, dtype=torch.bool).tril(-window)
        scores = scores.masked_fill(hidden, float("-inf"))
        out.append(torch.einsum("hqk,hkd->qhd", scores.softmax(-1), v[:, s]))
        start += length
    return torch.cat(out)


def check(lengths, heads, kv_heads, head_dim, dtype=torch.float32, device="cpu", tolerance=1e-6, sdpa=True,
          varlen="flash", window=None):
    query, key, value, cu = engine_layout(lengths, heads, kv_heads, head_dim, dtype, device)
    scale = 1 / math.sqrt(head_dim)
    out = attention_over_new_tokens(query, key, value, equal_length_runs(lengths), cu, max(lengths), scale,
                                    sdpa=sdpa, varlen=varlen, window=window)
    ref = naive(query, key, value, lengths, scale, window)
    assert out.shape == (sum(lengths), heads, head_dim) and out.dtype == dtype
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert err < tolerance, f"relative error {err:.2e} for lengths {lengths}"


def test_runs_group_adjacent_equal_lengths():
    assert equal_length_runs([4, 4, 2, 4]) == [ChunkRun(0, 2, 4), ChunkRun(8, 1, 2), ChunkRun(10, 1, 4)]
    assert equal_length_runs([]) == []
    with pytest.raises(ValueError, match=r"chunk lengths must be positive, got \[3, 0\]"):
        equal_length_runs([3, 0])


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=7), group=st.sampled_from([1, 3, 4]),
       kv_heads=st.sampled_from([1, 2]), head_dim=st.sampled_from([8, 64]))
def test_random_chunks_match_naive(lengths, group, kv_heads, head_dim):
    check(lengths, kv_heads * group, kv_heads, head_dim)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=7), window=st.integers(1, 45),
       group=st.sampled_from([1, 3]))
def test_random_chunks_in_a_sliding_window_match_naive(lengths, window, group):
    check(lengths, 2 * group, 2, 16, window=window)


def test_equal_lengths_are_one_call_and_the_result_lands_in_out():
    query, key, value, cu = engine_layout([5, 5, 5], 4, 2, 16, torch.float32, "cpu")
    out = torch.full((15, 4, 16), float("nan"))
    returned = attention_over_new_tokens(query, key, value, equal_length_runs([5, 5, 5]), cu, 5, 0.25, out=out)
    assert returned is out and not out.isnan().any()


def test_shape_mismatches_raise_clear_errors():
    query, key, value, cu = engine_layout([3, 2], 4, 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"runs .* cover 6 tokens, query has 5"):
        attention_over_new_tokens(query, key, value, [ChunkRun(0, 2, 3)], cu, 3, 0.3)
    with pytest.raises(ValueError, match=r"Hq a multiple of Hkv"):
        attention_over_new_tokens(query[:3], key, value, equal_length_runs([3, 2]), cu, 3, 0.3)


def test_the_path_taken_is_logged(caplog):
    chunk_attention._logged.clear()
    with caplog.at_level(logging.DEBUG, logger="ponytail.kernels"):
        check([4, 4, 3], 4, 2, 8)
    assert "torch SDPA over the chunks' own K/V, one call per run of equal lengths (2 runs)" in caplog.text


def test_sdpa_only_for_run_shapes_that_recur():
    shapes = SdpaShapes()
    step = equal_length_runs([64, 64, 300])  # (2 x 64), (1 x 300)
    assert [shapes.recurring(step) for _ in range(4)] == [False, False, True, True]  # PLAN_AFTER = 2
    assert not shapes.recurring(equal_length_runs([64, 64, 301]))  # one new shape is enough to wait
    assert shapes.recurring(equal_length_runs([300, 64, 64]))  # the same shapes in another order


def test_sdpa_shapes_forget_past_their_limit():
    shapes = SdpaShapes(limit=3)
    for _ in range(3):
        shapes.recurring(equal_length_runs([5]))
    assert shapes.recurring(equal_length_runs([5]))
    for length in (6, 7, 8):  # a fourth shape: everything is forgotten
        shapes.recurring(equal_length_runs([length]))
    assert not shapes.recurring(equal_length_runs([5]))


def test_new_shapes_still_use_sdpa_where_flash_cannot_run(caplog):
    """On the CPU (no flash) sdpa=False changes nothing: SDPA is the only way."""
    chunk_attention._logged.clear()
    with caplog.at_level(logging.DEBUG, logger="ponytail.kernels"):
        check([4, 4, 3], 4, 2, 8, sdpa=False)
    assert "torch SDPA" in caplog.text


# ----------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths", [[512] * 4, [300, 300, 7, 7, 7, 64],  # SDPA runs
                                     [17, 300, 5, 64, 128, 9, 250, 1]])  # more runs: flash varlen
def test_gpu_paths_match_the_reference(dtype, lengths, caplog):
    chunk_attention._logged.clear()
    with caplog.at_level(logging.DEBUG, logger="ponytail.kernels"):
        check(lengths, 32, 8, 128, dtype=dtype, device="cuda", tolerance=2e-2)
    many = len(equal_length_runs(lengths)) > chunk_attention.MAX_SDPA_RUNS
    assert ("flash varlen" if many else "torch SDPA") in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("window", [1, 33, 250])
def test_gpu_sliding_windows_match_the_reference(dtype, window, caplog):
    """A window narrower than the longest chunk: flash varlen's left window (fp32: SDPA with a mask)."""
    chunk_attention._logged.clear()
    with caplog.at_level(logging.DEBUG, logger="ponytail.kernels"):
        check([512, 512, 300, 7], 32, 8, 128, dtype=dtype, device="cuda", window=window,
              tolerance=1e-5 if dtype == torch.float32 else 2e-2)
    expected = "torch SDPA" if dtype == torch.float32 else "flash varlen over the chunks' own K/V (3 runs in a sliding"
    assert expected in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_new_shapes_take_flash_varlen(dtype, caplog):
    """Run shapes not seen before skip SDPA (cuDNN would build a plan inside the step)."""
    chunk_attention._logged.clear()
    with caplog.at_level(logging.DEBUG, logger="ponytail.kernels"):
        check([300, 300, 7], 32, 8, 128, dtype=dtype, device="cuda", tolerance=2e-2, sdpa=False)
    assert "flash varlen over the chunks' own K/V (2 new shapes)" in caplog.text
    assert "torch SDPA" not in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (32, 32, 128), (9, 3, 64)])
def test_gpu_fa4_varlen_matches_the_reference(dtype, heads, kv_heads, head_dim, caplog):
    """FlashAttention-4 (prefill_attention="fa4") on the engine's strided layout, where installed."""
    from ponytail.attention.fa4 import fa4_problem

    problem = fa4_problem(torch.device("cuda"), dtype, head_dim)
    if problem is not None:
        pytest.skip(f"FlashAttention-4 cannot run here: {problem}")
    chunk_attention._logged.clear()
    with caplog.at_level(logging.DEBUG, logger="ponytail.kernels"):
        check([17, 300, 5, 64, 128, 9, 250, 1], heads, kv_heads, head_dim, dtype=dtype, device="cuda",
              tolerance=2e-2, sdpa=False, varlen="fa4")
    assert "fa4 varlen over the chunks' own K/V" in caplog.text
