"""A KV pool whose device refuses memory: growth fails as "no room", never as an error.

The budget is a ceiling computed at start; another tenant of the device may hold that memory by
the time the pool grows. Here the device's refusal is injected (the chunk allocation raising
torch.OutOfMemoryError past a number of chunks); tests/test_gpu_kv_out_of_memory.py does it for real.
"""

import logging

import pytest
import torch

import ponytail
from ponytail import CacheConfig, NoRoom, PagedKVCache, SamplingParams
from ponytail.kv import storage as storage_module  # noqa: E402
from ponytail.kv.budget import kv_budget
from test_engine import make_llm, plain_greedy, random_prompts


class Refusals(list):
    """The chunk counts at which the device refused a chunk; `limit` None lets everything through."""

    limit: int | None = None


def refuse_chunks_past(monkeypatch, storage, limit: int) -> Refusals:
    """Make the device refuse any chunk of `storage` beyond `limit` (its allocation in storage.py)."""
    refusals = Refusals()
    refusals.limit = limit
    real_allocation = storage_module.aligned_empty

    def allocation(*args, **kwargs):
        if refusals.limit is not None and len(storage.chunks) >= refusals.limit:
            refusals.append(len(storage.chunks))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
        return real_allocation(*args, **kwargs)

    monkeypatch.setattr(storage_module, "aligned_empty", allocation)
    return refusals


def test_a_refused_growth_is_no_room_logged_once_with_numbers(monkeypatch, caplog):
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", max_batch_size=1,
                         max_seq_len=48, block_size=4, chunk_blocks=4, device="cpu")
    cache = PagedKVCache(config)
    refusals = refuse_chunks_past(monkeypatch, cache.storage, limit=2)
    cache.GROW_RETRY_S = 0.0  # try the device at every call, to see the log stay at one line
    assert cache.allocate(1, list(range(20)))  # 5 blocks: the second chunk still fits
    with caplog.at_level(logging.DEBUG, logger="ponytail.kv"):
        refused = cache.allocate(2, list(range(100, 116)))  # 4 more blocks: a third chunk, refused
        assert isinstance(refused, NoRoom) and refused.needed == 4 and refused.free == 3
        assert not cache.append(1, list(range(16)))  # 4 blocks: again refused, no exception
    assert cache.num_chunks == 2 and cache.stats().total_blocks == 8
    assert cache.num_growth_failures == 2 and refusals == [2, 2]
    assert cache.invariants() == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith("KV pool could not grow past 2 of 3 chunks (2.0 KB each, 4.1 KB held): "
                                  "the device is out of memory (free ? of ?)")
    assert "CUDA out of memory. Tried to allocate 2.00 MiB (injected)" in warnings[0]


def test_growth_is_retried_after_a_pause(monkeypatch):
    config = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", max_batch_size=1,
                         max_seq_len=48, block_size=4, chunk_blocks=4, device="cpu")
    cache = PagedKVCache(config)
    refusals = refuse_chunks_past(monkeypatch, cache.storage, limit=1)
    clock = [100.0]
    monkeypatch.setattr("ponytail.kv.paged_cache.time.monotonic", lambda: clock[0])
    assert cache.grow(1) == 0 and len(refusals) == 1
    assert cache.grow(1) == 0 and len(refusals) == 1  # within GROW_RETRY_S: the device is not asked
    refusals.limit = None  # the other tenant left
    clock[0] += cache.GROW_RETRY_S
    assert cache.grow(1) == 1 and cache.num_chunks == 2


def test_the_engine_preempts_instead_of_crashing_and_outputs_equal_plain_generate(small_model, monkeypatch):
    # 4 MiB of budget would hold every sequence; the device stops giving memory at 3 chunks of 16
    # blocks of 4 tokens (192 tokens), while 8 sequences grow to ~70 tokens each (~140 blocks).
    llm = make_llm(small_model, max_num_batched_tokens=64)
    cache = llm.engine.cache
    assert cache.max_chunks * cache.storage.chunk_blocks > 8 * 70 // 4
    refusals = refuse_chunks_past(monkeypatch, cache.storage, limit=3)
    prompts = random_prompts(8, seed=1, low=20, high=40)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert refusals and cache.num_growth_failures >= 1 and cache.num_chunks == 3
    stats = llm.stats()
    assert stats.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == plain_greedy(small_model[0], prompt, 40)
    assert stats.used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert cache.invariants() == []


def test_gpu_memory_utilization_is_checked():
    with pytest.raises(ponytail.ConfigError, match=r"gpu_memory_utilization=1.5 is not supported; allowed: a share "
                                                    r"of the device's total memory in \(0, 1\]"):
        kv_budget(None, torch.device("cpu"), 1.5)
    with pytest.raises(ponytail.ConfigError, match=r"gpu_memory_utilization=0.5 needs a CUDA device; the model is "
                                                    r"on cpu: use kv_cache_memory"):
        kv_budget(None, torch.device("cpu"), 0.5)
    with pytest.raises(ponytail.ConfigError, match=r"kv_cache_memory='1GiB' and gpu_memory_utilization=0.5 were "
                                                    r"both given; allowed: one of them"):
        kv_budget("1GiB", torch.device("cpu"), 0.5)


@pytest.mark.parametrize("free_gib, reserved_gib, expected_gib", [
    (66, 14, 58),  # an 80 GiB device, 14 GiB of weights: 90% of it less the weights (a step fits in the 10%)
    (64, 14, 58),  # the CUDA context and libraries' workspaces (2 GiB outside torch) sit in the 10% too
    (26, 14, 25),  # another tenant holds 40 GiB: what is free less a step
    (6, 74, 58),  # an earlier engine's 60 GiB pool, freed but cached by torch: available all the same
    (8, 14, 7),  # 58 GiB outside torch: the step's activations still stay free
])
def test_default_kv_ceiling_is_vllms_share_of_the_device(monkeypatch, free_gib, reserved_gib, expected_gib):
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_gib * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved_gib * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 14 * gib)
    budget = kv_budget(None, torch.device("cuda", 0), None, headroom=gib)
    assert budget == expected_gib * gib


def test_default_kv_ceiling_on_a_full_device_is_refused_by_name(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (gib // 2, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 14 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 14 * gib)
    with pytest.raises(ponytail.ConfigError, match=r"kv_cache_memory=None leaves no KV memory on cuda:0: 85.4 GB of "
                                                    r"85.9 GB in use .* allowed: an explicit kv_cache_memory"):
        kv_budget(None, torch.device("cuda", 0), None, headroom=gib)
