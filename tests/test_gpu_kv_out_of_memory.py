"""Another tenant takes most of the GPU after the engine started: the KV pool stops growing, the
engine preempts instead of dying with torch.OutOfMemoryError, and outputs are unchanged."""

import gc
import os
import random
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ponytail
from ponytail import SamplingParams

pytestmark = pytest.mark.gpu


def small_model():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).to("cuda", torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # no greedy near-ties on random weights
    return model


def test_a_full_device_means_preemption_not_a_crash():
    """In a process of its own: inside the whole suite, earlier tests' engines left torch memory
    reserved (CUDA-graph pools, ~200 MiB on the H200) that the pool counts as free, more than the
    headroom this test must leave, so it could not control what the device has free."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_gpu_kv_out_of_memory as t; t.full_device()"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    print(run.stdout)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]


def full_device():
    model = small_model()
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(100, 300))] for _ in range(16)]
    max_tokens = 400
    expected = []
    for p in prompts:
        out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    # 64 KiB blocks of 16 tokens, chunks of 64 blocks (4 MiB): the workload needs ~10 chunks, the
    # 256 MiB budget allows 64, so only the device can stop the pool.
    # No CUDA graphs: their private memory pools stay reserved by torch (213 MiB inside the whole
    # suite on the H200), which the pool counts as free, and this test must control what is free.
    llm = ponytail.LLM(model, kv_cache_memory="256MiB", max_num_seqs=16, max_model_len=1024,
                       max_num_batched_tokens=512, kv_release_after_s=0, cuda_graphs=False)
    cache = llm.engine.cache
    warm = llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in warm] == [e[:4] for e in expected[:2]]
    cache.maintain()  # start small: only growth can make room now
    assert cache.num_chunks <= 2, cache.num_chunks
    gc.collect()  # earlier tests' engines (and their CUDA-graph pools) go before the device is measured
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    # The pool counts torch's cached memory (reserved, not allocated) as free too, so the device is
    # left with room for 3 chunks counting that memory.
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    leave = cache.device_headroom_bytes + 3 * cache.storage.chunk_bytes - cached
    assert leave > 0, f"{cached >> 20} MiB cached by torch: more than the headroom the test needs to leave"
    filler = torch.empty(free - leave, dtype=torch.uint8, device="cuda")  # the other tenant
    try:
        assert torch.cuda.mem_get_info()[0] < leave + (64 << 20)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        stats = llm.stats()
        print(f"device {total >> 20} MiB, left free {leave >> 20} MiB (+{cached >> 20} MiB cached); pool {cache.num_chunks} of "
              f"{cache.max_chunks} chunks; growth refused {cache.num_growth_failures} times; "
              f"preemptions {stats.num_preemptions}")
        assert cache.num_growth_failures > 0
        assert stats.num_preemptions > 0
        assert cache.num_chunks < 10
        assert [o.token_ids for o in outputs] == expected
        assert stats.used_blocks == 0 and cache.invariants() == []
    finally:
        del filler
        torch.cuda.empty_cache()
