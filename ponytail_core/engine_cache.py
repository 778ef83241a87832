"""The transformers `Cache` the engine drives: one packed forward pass per step.

Every scheduled request's new tokens are packed into one [1, N] batch (no padding in the model's
matmuls). Attention then splits them again: single-token chunks (decode) go to the paged decode
kernel together; longer chunks (prefill, chunked prefill, recompute) go to the chunk path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .hf_cache import PagedCacheBase, attention_without_context
from .paged_attention import paged_attention


@dataclass(slots=True)
class ChunkGroup:
    """Chunks attended together: positions in the packed batch, left-padded to one width."""

    index: torch.Tensor  # [rows, width] int64 positions in the packed batch (padding: 0)
    valid: torch.Tensor  # [rows, width] bool, real positions (right-aligned)
    block_tables: torch.Tensor  # [rows, max_blocks] int32
    seq_lens: torch.Tensor  # [rows] int32: tokens in the cache after this step
    query_lens: torch.Tensor  # [rows] int32: real positions per row
    has_context: bool  # some row had tokens in the cache before this step


@dataclass(slots=True)
class PackedStep:
    num_tokens: int  # N
    slot_mapping: torch.Tensor  # [N] int64
    decode: ChunkGroup | None  # width 1
    prefill: ChunkGroup | None


class PackedStepCache(PagedCacheBase):
    def __init__(self, paged):
        super().__init__(paged)
        self.step: PackedStep | None = None

    def attend(self, layer_idx, module, query, key, value, attention_mask, scale, sliding_window):
        step = self.step
        if layer_idx == 0:
            self.check_model(module, query, key, sliding_window)
        self.write_new_kv(layer_idx, key, value, step.slot_mapping)
        q_tok = query[0].transpose(0, 1)  # [N, Hq, D]
        out = torch.empty_like(q_tok)
        storage = self.paged.storage
        if step.decode is not None:
            group = step.decode
            index = group.index[:, 0]
            q = q_tok.index_select(0, index).unsqueeze(2)  # [rows, Hq, 1, D]
            result = paged_attention(storage, layer_idx, q, group.block_tables, group.seq_lens, None, scale)
            out.index_copy_(0, index, result[:, :, 0])
        if step.prefill is not None:
            group = step.prefill
            q = q_tok[group.index].transpose(1, 2)  # [rows, Hq, width, D]
            if group.has_context:
                result = paged_attention(storage, layer_idx, q, group.block_tables, group.seq_lens,
                                         group.query_lens, scale)
            else:  # every chunk starts its sequence: its own K/V are the whole context
                k = key[0].transpose(0, 1)[group.index].transpose(1, 2)
                v = value[0].transpose(0, 1)[group.index].transpose(1, 2)
                result = attention_without_context(q, k, v, group.valid, scale)
            out[group.index[group.valid]] = result.transpose(1, 2)[group.valid]
        self._awaiting_attention = None
        return out.unsqueeze(0)
