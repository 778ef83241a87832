"""Runs one engine step through a stock transformers model: packed inputs in, logits out."""

from __future__ import annotations

import torch

from . import hf_attention
from .engine_cache import ChunkGroup, PackedStep, PackedStepCache
from .paged_cache import PagedKVCache
from .scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache):
        self.model = model
        self.device = cache.config.device
        model.set_attn_implementation(hf_attention.ATTN_IMPLEMENTATION)
        self.hf_cache = PackedStepCache(cache)
        self.block_size = cache.config.block_size

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Compute every chunk's tokens; returns float32 logits [sampling chunks, vocab] in chunk order."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_at: list[int] = []
        decode, prefill = [], []
        for chunk in chunks:
            offset = len(input_ids)
            tokens = chunk.request.all_token_ids[chunk.start : chunk.start + chunk.num_tokens]
            input_ids.extend(tokens)
            positions.extend(range(chunk.start, chunk.start + chunk.num_tokens))
            slots.extend(chunk.slots)
            (decode if chunk.num_tokens == 1 else prefill).append((chunk, offset))
            if chunk.samples:
                sample_at.append(offset + chunk.num_tokens - 1)
        self.hf_cache.step = PackedStep(
            num_tokens=len(input_ids), slot_mapping=self._tensor(slots, torch.int64),
            decode=self._group(decode), prefill=self._group(prefill))
        out = self.model(input_ids=self._tensor(input_ids, torch.int64)[None],
                         position_ids=self._tensor(positions, torch.int64)[None],
                         cache=self.hf_cache, use_cache=True,
                         logits_to_keep=self._tensor(sample_at, torch.int64))
        return out.logits[0].float()

    def _group(self, members: list[tuple[ScheduledChunk, int]]) -> ChunkGroup | None:
        if not members:
            return None
        width = max(chunk.num_tokens for chunk, _ in members)
        index, valid, tables, seq_lens, query_lens = [], [], [], [], []
        allocator = self.hf_cache.paged.allocator
        for chunk, offset in members:
            pad = width - chunk.num_tokens
            index.append([0] * pad + list(range(offset, offset + chunk.num_tokens)))
            valid.append([False] * pad + [True] * chunk.num_tokens)
            end = chunk.start + chunk.num_tokens
            tables.append(allocator.block_table(chunk.request.request_id)[: -(-end // self.block_size)])
            seq_lens.append(end)
            query_lens.append(chunk.num_tokens)
        max_blocks = max(len(t) for t in tables)
        tables = [t + [0] * (max_blocks - len(t)) for t in tables]
        return ChunkGroup(
            index=self._tensor(index, torch.int64), valid=self._tensor(valid, torch.bool),
            block_tables=self._tensor(tables, torch.int32), seq_lens=self._tensor(seq_lens, torch.int32),
            query_lens=self._tensor(query_lens, torch.int32),
            has_context=any(chunk.start > 0 for chunk, _ in members))

    def _tensor(self, values, dtype) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":  # one pinned, non-blocking copy per tensor
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor
