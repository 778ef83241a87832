"""Sliding windows on CUDA (marked gpu): the decode kernel's `_w` variants, flash's left window
(torch's flash and FlashAttention-4) and the masked SDPA path against an fp64 reference, then the
plug-in and the engine (CUDA graphs, async scheduling) against plain transformers generate."""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch
import ponytail
from ponytail import SamplingParams
from ponytail.attention import decode
from ponytail.attention.fa4 import fa4_problem
from ponytail.attention.paged import paged_attention, paged_attention_varlen
from cache_machine import kernels
from test_gpu_paged_attention import TOLERANCE, make_batch, poison_like, reference, rel, unpack_rows, varlen_case
from test_sliding_window import window_models

pytestmark = pytest.mark.gpu

LENGTHS = [0, 1, 15, 16, 17, 100, 1000, 3000]


def decode_case(lengths, window, dtype, head_dim=128, kv_heads=2, group=4, seed=0, launch=None):
    storage, tables, seq_lens = make_batch(lengths, kv_heads, head_dim, dtype, seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    query = torch.randn(len(lengths), kv_heads * group, 1, head_dim, generator=gen, device="cuda").to(dtype)
    scale = 1 / math.sqrt(head_dim)
    old = dict(decode.LAUNCH)
    decode.LAUNCH.update(launch or {})
    try:
        poison_like(query.shape, dtype)
        with kernels("cupy"):
            out = paged_attention(storage, 1, query, tables, seq_lens, None, scale, sliding_window=window)
        torch.cuda.synchronize()
    finally:
        decode.LAUNCH.clear()
        decode.LAUNCH.update(old)
    ref = reference(storage, 1, query, tables, seq_lens, None, scale, window)
    with kernels("torch"):
        fallback = paged_attention(storage, 1, query, tables, seq_lens, None, scale, sliding_window=window)
    err, nans = rel(out, ref), int(torch.isnan(out).sum())
    line = f"\n  {dtype} D={head_dim} G={group} window={window} lengths={lengths}: rel={err:.2e} nan={nans} " \
           f"fallback_vs_ref={rel(fallback, ref):.2e}"
    print(line, end="")
    assert nans == 0, line
    assert err < TOLERANCE[dtype], line
    assert torch.all(out[torch.tensor(lengths, device="cuda") == 0] == 0), line
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("window", [1, 16, 33, 1000])
def test_windowed_decode_matches_the_reference(dtype, head_dim, group, window):
    """Windows of one token, one block, mid-block and longer than most rows."""
    decode_case(LENGTHS, window, dtype, head_dim=head_dim, group=group, seed=window)


@pytest.mark.parametrize("window", [300, 3000, 7999])
def test_windowed_decode_splits_long_rows(window):
    """Many splits from the window's first block on; the reduce counts the splits that ran."""
    decode_case([8000, 5000, 20, 3001], window, torch.bfloat16, launch={"min_split_tokens": 128}, seed=7)


def test_a_windowed_decode_plans_its_splits_over_the_window_not_the_table():
    storage, tables, _ = make_batch([8000], 2, 128, torch.bfloat16)
    whole = decode.decode_plan(storage, 1, 8, tables.shape[1])
    narrow = decode.decode_plan(storage, 1, 8, tables.shape[1], window=64)
    assert narrow.kernel_name == whole.kernel_name + "_w"
    assert narrow.splits * narrow.split_tokens <= 64 + 2 * 16 < whole.splits * whole.split_tokens


def test_windowed_decode_replays_in_a_cuda_graph_with_new_lengths():
    storage, tables, seq_lens = make_batch([900, 40, 2000], 2, 128, torch.bfloat16, seed=3)
    query = torch.randn(3, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    with kernels("cupy"):
        paged_attention(storage, 1, query, tables, seq_lens, None, 0.088, sliding_window=100)  # compile, plan
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = paged_attention(storage, 1, query, tables, seq_lens, None, 0.088, sliding_window=100)
        seq_lens.copy_(torch.tensor([17, 40, 1500], dtype=torch.int32))
        query.normal_()
        graph.replay()
        direct = paged_attention(storage, 1, query, tables, seq_lens, None, 0.088, sliding_window=100)
    torch.cuda.synchronize()
    ref = reference(storage, 1, query, tables, seq_lens, None, 0.088, 100)
    assert rel(out, ref) < TOLERANCE[torch.bfloat16] and torch.equal(out, direct)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("varlen", ["flash", "fa4"])
@pytest.mark.parametrize("window", [1, 64, 700])
def test_windowed_varlen_rows_match_the_reference(dtype, varlen, window, caplog):
    """Chunks with context (the engine's varlen call); fp32 takes the padded gather + masked SDPA."""
    if varlen == "fa4" and (problem := fa4_problem(torch.device("cuda"), dtype, 128)):
        pytest.skip(f"FlashAttention-4 cannot run here: {problem}")
    case = varlen_case(dtype, heads=8, seed=window)
    scale = 1 / math.sqrt(128)
    with kernels("cupy"):
        out = paged_attention_varlen(case.storage, 1, case.packed, case.cu, case.width, case.tables, case.seq_lens,
                                     scale, varlen=varlen, num_keys=case.num_keys, sliding_window=window)
    ref = unpack_rows(reference(case.storage, 1, case.query, case.tables, case.seq_lens, case.counts_tensor(), scale,
                                window), case.width)
    err = rel(out, ref)
    print(f"\n  varlen {dtype} {varlen} window={window}: rel={err:.2e}", end="")
    assert not torch.isnan(out).any() and err < TOLERANCE[dtype]


WINDOW = 48
SHAPE = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
             vocab_size=1000, max_position_embeddings=1024)  # head_dim 64: the decode kernel has it
GPU_MODELS = window_models(SHAPE, WINDOW)


def gpu_model(name, dtype=torch.float32):
    torch.manual_seed(0)
    model = GPU_MODELS[name]().to("cuda", dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # no greedy near-ties on random weights
    return model


def gpu_prompts(seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(rng.randint(5, 300))] for _ in range(10)]


def plain_greedy(model, prompt, new):
    model.set_attn_implementation("eager")
    out = model.generate(torch.tensor([prompt], device="cuda"), attention_mask=torch.ones(1, len(prompt),
                         dtype=torch.long, device="cuda"), max_new_tokens=new, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", list(GPU_MODELS))
def test_plugin_generate_on_cuda_equals_plain_generate(name):
    gen = torch.Generator().manual_seed(1)
    lengths = [120, 9, 70, 2]  # left padded, longer and shorter than the window
    ids = torch.zeros(4, 120, dtype=torch.long)
    mask = torch.zeros(4, 120, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, 120 - n:] = torch.randint(1, 1000, (n,), generator=gen)
        mask[row, 120 - n:] = 1
    ids, mask = ids.cuda(), mask.cuda()
    reference_model = gpu_model(name)
    reference_model.set_attn_implementation("eager")
    expected = reference_model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
    model = gpu_model(name)
    cache = ponytail.create_cache(model=model, max_batch_size=4, max_seq_len=256)
    with kernels("cupy"):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None,
                             pad_token_id=0, cache=cache)
    assert torch.equal(got, expected), f"{name}: {got[:, ids.shape[1]:]} != {expected[:, ids.shape[1]:]}"


@pytest.mark.parametrize("name", list(GPU_MODELS))
@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 64, "max_num_seqs": 8}],
                         ids=["defaults", "chunked"])
def test_engine_on_cuda_past_the_window_equals_plain_generate(name, settings, caplog):
    """fp32 with the engine's GPU defaults (CUDA graphs, async scheduling): decode graphs replay
    the windowed kernel, prompt chunks take the masked SDPA paths (no flash in fp32)."""
    prompts = gpu_prompts()
    reference_model = gpu_model(name)
    expected = [plain_greedy(reference_model, p, 24) for p in prompts]
    with kernels("cupy"), caplog.at_level(logging.DEBUG, logger="ponytail.kernels"):
        llm = ponytail.LLM(gpu_model(name), kv_cache_memory="64MiB", max_model_len=512, **settings)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays > 0
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert "paged_attention decode: custom kernel" in caplog.text


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
@pytest.mark.parametrize("prefill_attention", ["flash", "fa4"])
def test_bf16_engine_first_tokens_past_the_window_match_plain_transformers(name, prefill_attention):
    """bf16: chunks with and without context through flash's left window (torch's or
    FlashAttention-4's); near ties (bf16 may pick either) are skipped, as in test_gpu_engine."""
    if prefill_attention == "fa4" and (problem := fa4_problem(torch.device("cuda"), torch.bfloat16, 64)):
        pytest.skip(f"FlashAttention-4 cannot run here: {problem}")
    model = gpu_model(name, torch.bfloat16)
    rng = random.Random(1)
    shared = [rng.randrange(1, 1000) for _ in range(160)]
    prompts = [shared + [rng.randrange(1, 1000) for _ in range(rng.randint(1, 200))] for _ in range(10)]
    prompts += [[rng.randrange(1, 1000) for _ in range(rng.randint(300, 700))] for _ in range(4)]
    with kernels("cupy"):
        llm = ponytail.LLM(model, kv_cache_memory="64MiB", max_num_seqs=8, max_model_len=1024,
                           max_num_batched_tokens=256, prefill_attention=prefill_attention)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert llm.stats().prefix_cache_hits > 0
    model.set_attn_implementation("eager")
    checked = 0
    with torch.no_grad():
        for prompt, output in zip(prompts, outputs):
            logits = model(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
            top2 = logits.topk(2)
            if (top2.values[0] - top2.values[1]).item() < 0.5:
                continue
            checked += 1
            assert output.token_ids == [int(top2.indices[0])]
    assert checked >= len(prompts) // 2
