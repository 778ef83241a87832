"""A hypothesis state machine over a paged KV cache, shared by the CPU and GPU tests.

Every live sequence's K/V is checked, bit for bit, against a shadow computed from its tokens
after every step. K/V are a deterministic function of the token prefix (as in a real model), so
prefix-cache hits must return exactly what a fresh write would have stored.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from ponytail import CacheConfig, PagedKVCache

SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=14)  # tiny vocab: prefix hits happen


@contextmanager
def kernels(mode: str):
    old = os.environ.get("PONYTAIL_KERNELS")
    os.environ["PONYTAIL_KERNELS"] = mode
    try:
        yield
    finally:
        if old is None:
            del os.environ["PONYTAIL_KERNELS"]
        else:
            os.environ["PONYTAIL_KERNELS"] = old


def kv_for_prefix(prefix: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """K/V [layers, 2, kv_heads, head_dim] of the last token of `prefix`."""
    gen = torch.Generator().manual_seed(hash(prefix) & 0x7FFF_FFFF_FFFF_FFFF)
    shape = (SHAPE["num_layers"], 2, SHAPE["num_kv_heads"], SHAPE["head_dim"])
    return torch.randn(shape, generator=gen).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Exact bit pattern, so comparisons are bit for bit whatever the dtype."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


class CacheMachine(RuleBasedStateMachine):
    """Subclasses set DEVICE, DTYPE and MODES: one cache per kernel mode, run in lockstep."""

    DEVICE = "cpu"
    DTYPE = torch.float32
    MODES = ("torch",)

    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        config = CacheConfig(**SHAPE, dtype=self.DTYPE, max_batch_size=4, max_seq_len=24,
                             chunk_blocks=4, device=self.DEVICE)  # 24 blocks, up to 6 chunks
        self.caches = {mode: PagedKVCache(config) for mode in self.MODES}
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    def each(self, fn):
        """Run fn(cache) on every cache under its kernel mode; the results must agree."""
        results = []
        for mode, cache in self.caches.items():
            with kernels(mode):
                results.append(fn(cache))
        return results

    def write(self, cache: PagedKVCache, tokens: list[int], start: int, slots: list[int]) -> None:
        if not slots:
            return
        kv = torch.stack([kv_for_prefix(tuple(tokens[: p + 1]), self.DTYPE)
                          for p in range(start, start + len(slots))], dim=2)  # [L, 2, T, H, D]
        kv = kv.to(cache.storage.device)
        cache.write(kv[:, 0], kv[:, 1], slots)

    @rule(target=seqs, tokens=tokens_st)
    def allocate(self, tokens):
        seq_id = self.next_id
        self.next_id += 1

        def run(cache):
            result = cache.allocate(seq_id, tokens)
            if result:
                self.write(cache, tokens, result.num_cached_tokens, result.slots)
                cache.mark_computed(seq_id, len(tokens))
            return bool(result), getattr(result, "slots", None)

        outcomes = self.each(run)
        assert len(set(map(repr, outcomes))) == 1, outcomes
        if outcomes[0][0]:
            self.tokens[seq_id] = list(tokens)
        return seq_id

    @rule(seq=seqs, new=tokens_st)
    def append(self, seq, new):
        if seq not in self.tokens:
            return
        start = len(self.tokens[seq])
        full = self.tokens[seq] + new

        def run(cache):
            result = cache.append(seq, new)
            if result:
                self.write(cache, full, start, result.slots)
                cache.mark_computed(seq, len(full))
            return bool(result), getattr(result, "slots", None)

        outcomes = self.each(run)
        assert len(set(map(repr, outcomes))) == 1, outcomes
        if outcomes[0][0]:
            self.tokens[seq] = full

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        child = self.next_id
        self.next_id += 1
        if parent in self.tokens:
            self.each(lambda cache: cache.fork(parent, child))
            self.tokens[child] = list(self.tokens[parent])
        return child

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq in self.tokens:
            self.each(lambda cache: cache.free(seq))
            del self.tokens[seq]

    @rule()
    def defragment(self):
        results = self.each(lambda cache: cache.defragment())
        assert len(set(results)) == 1
        for cache in self.caches.values():
            assert cache.fragmentation == 0.0

    @rule(chunks=st.integers(1, 3))
    def grow(self, chunks):
        self.each(lambda cache: cache.grow(chunks))

    @rule(keep=st.integers(0, 8))
    def shrink(self, keep):
        self.each(lambda cache: cache.shrink(keep_free_blocks=keep))

    @rule()
    def maintain(self):
        self.each(lambda cache: cache.maintain())

    @invariant()
    def consistent(self):
        for cache in self.caches.values():
            assert cache.invariants() == []
            assert cache.stats().used_blocks <= cache.stats().total_blocks
        tables = [{s: cache.block_table(s) for s in self.tokens} for cache in self.caches.values()]
        assert all(t == tables[0] for t in tables)
        for seq, tokens in self.tokens.items():
            expected = torch.stack([kv_for_prefix(tuple(tokens[: p + 1]), self.DTYPE)
                                    for p in range(len(tokens))], dim=2) if tokens else None
            for cache in self.caches.values():
                got = cache.read(seq).cpu()
                assert got.shape[2] == len(tokens)
                if tokens:
                    assert torch.equal(bits(got), bits(expected)), f"seq {seq} K/V differ"
