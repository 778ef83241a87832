"""The transformers `Cache` the engine drives: one packed forward pass per step.

Every scheduled request's new tokens are packed into one [1, N] batch (no padding in the model's
matmuls): decode tokens first, one per row, then the prefill chunks end to end. Attention splits
them again: the decode rows go to the paged decode kernel together, the prefill chunks (prefill,
chunked prefill, recompute, prefix hits) to the varlen path, each chunk against its own cached
context. When no chunk has context (every chunk starts its sequence) they attend the step's own
K/V instead (chunks.py), without reading the blocks back. With FlashAttention-4 the chunks read
the blocks in place through one page table a step (kv/page_view.py) instead of a packed gather.
On the torch path (the CPU) every row that reads the blocks goes through one plan per step
(attention/torch_varlen.py), unpadded.

On CUDA the decode kernel writes the decode rows' new K/V itself (attention/decode.py's
NewTokenKV: one launch fewer per layer); the prefill chunks' go through cache_ops.write_slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.chunks import ChunkRun, attention_over_new_tokens
from ..attention.decode import NewTokenKV
from ..attention.fa4 import fa4_pages_problem
from ..attention.hf_cache_base import PagedCacheBase
from ..attention.paged import paged_attention, paged_attention_varlen
from ..attention.torch_varlen import SlotWrites, TorchAttentionPlan, attention_torch_planned, plan_torch_attention
from ..kernels import loader as kernel_loader
from ..kv.page_view import StepPages


@dataclass(slots=True)
class DecodeRows:
    """Packed positions 0 .. rows - 1: one new token per row."""

    block_tables: torch.Tensor  # [rows, max_blocks] int32
    seq_lens: torch.Tensor  # [rows] int32: tokens in the cache after this step (0: a padding row)

    @property
    def rows(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(slots=True)
class PrefillChunks:
    """Packed positions start .. N - 1: the chunks end to end."""

    start: int
    cu_seq_q: torch.Tensor  # [chunks + 1] int32, cumulative chunk lengths from 0
    max_query_len: int
    block_tables: torch.Tensor  # [chunks, max_blocks] int32
    seq_lens: torch.Tensor  # [chunks] int32
    num_keys: int = 0  # sum of seq_lens, known on the host (0: not given)
    runs: list[ChunkRun] | None = None  # set when no chunk has context: equal-length runs of chunks
    sdpa: bool = True  # runs may go to SDPA: their shapes recur (chunk_attention.SdpaShapes)


@dataclass(slots=True)
class PackedStep:
    slot_mapping: torch.Tensor  # [N] int64, one slot per packed token (-1: padding, nothing written)
    decode: DecodeRows | None
    prefill: PrefillChunks | None


def fill_inputs(input_ids: torch.Tensor, sampled: torch.Tensor, index: torch.Tensor) -> None:
    """input_ids[index[0]] = sampled[index[1]], on the device: the tokens a step still in flight
    sampled become the next step's inputs without a round trip through the host."""
    input_ids.index_copy_(0, index[0], sampled.index_select(0, index[1]))


class PackedStepCache(PagedCacheBase):
    """prefill_varlen: the varlen kernel of the prefill chunks on CUDA, "flash" or "fa4" (attention/fa4.py)."""

    def __init__(self, paged, prefill_varlen: str = "flash"):
        super().__init__(paged)
        self.prefill_varlen = prefill_varlen
        self.step: PackedStep | None = None
        # The torch path's plans for `step` by sliding window (None: whole rows), built at the first
        # layer that needs each, and where the step's new K/V go.
        self._plans: dict[int | None, TorchAttentionPlan] = {}
        self._writes: SlotWrites | None = None
        # The chunks' tables as pages (FlashAttention-4 reads the blocks in place), for `_pages_of`.
        self._read_pages = prefill_varlen == "fa4" and fa4_pages_problem() is None and not paged.config.is_fp8
        self._pages: tuple[PrefillChunks, StepPages | None] | None = None

    def attend(self, layer_idx, module, query, key, value, attention_mask, scale, sliding_window):
        step = self.step
        if layer_idx == 0:
            self.check_model(module, query, key, sliding_window)
            self._plans = {}
            self._writes = SlotWrites(self.paged.storage, step.slot_mapping) if self._torch_path else None
        window = self.window(sliding_window)
        new_kv = None  # the decode rows' K/V, when the decode kernel writes them
        if self._writes is not None:
            self._writes.write(layer_idx, key[0].transpose(0, 1), value[0].transpose(0, 1))
        elif step.decode is not None:
            rows = step.decode.rows
            new_kv = NewTokenKV(key[0, :, :rows].transpose(0, 1), value[0, :, :rows].transpose(0, 1),
                                step.slot_mapping[:rows])
            if step.prefill is not None:
                self.write_new_kv(layer_idx, key[:, :, rows:], value[:, :, rows:], step.slot_mapping[rows:])
        else:
            self.write_new_kv(layer_idx, key, value, step.slot_mapping)
        q_tok = query[0].transpose(0, 1)  # [N, Hq, D]
        storage = self.paged.storage
        chunks = step.prefill
        self._awaiting_attention = None
        if self._torch_path and (chunks is None or chunks.runs is None or window is not None):
            # every row at once (a window takes the chunks that start their sequence too)
            return attention_torch_planned(storage, layer_idx, q_tok, self._plan(window), scale).unsqueeze(0)
        decode_out = None
        if step.decode is not None:
            rows = step.decode.rows
            if self._torch_path:
                decode_out = attention_torch_planned(storage, layer_idx, q_tok[:rows], self._plan(None), scale)
            else:
                q = q_tok[:rows].unsqueeze(2)  # [rows, Hq, 1, D], a view
                decode_out = paged_attention(storage, layer_idx, q, step.decode.block_tables, step.decode.seq_lens,
                                             None, scale, sliding_window=window, new_kv=new_kv)[:, :, 0]
        if chunks is None:
            return decode_out.unsqueeze(0)
        # Without decode rows the kernel's own output is the answer; with them the prefill rows are
        # written after theirs in one tensor (FlashAttention-4 in place, the other kernels copy).
        s = chunks.start
        out = None if decode_out is None else torch.empty(q_tok.shape, dtype=q_tok.dtype, device=q_tok.device)
        rows = None if out is None else out[s:]
        if chunks.runs is not None:  # every chunk starts its sequence: its own K/V are all it attends
            result = attention_over_new_tokens(query[0, :, s:], key[0, :, s:], value[0, :, s:], chunks.runs,
                                               chunks.cu_seq_q, chunks.max_query_len, scale, out=rows,
                                               sdpa=chunks.sdpa, varlen=self.prefill_varlen, window=window)
        else:
            result = paged_attention_varlen(storage, layer_idx, q_tok[s:], chunks.cu_seq_q, chunks.max_query_len,
                                            chunks.block_tables, chunks.seq_lens, scale, varlen=self.prefill_varlen,
                                            num_keys=chunks.num_keys, out=rows, sliding_window=window,
                                            pages=self._pages_of(chunks) if window is None else None)
        if out is None:
            return result.unsqueeze(0)
        out[:s] = decode_out
        return out.unsqueeze(0)  # [1, N, Hq, D]

    def _pages_of(self, chunks: PrefillChunks) -> StepPages | None:
        """The chunks' block tables as pages of the pool's page view: translated at the step's first
        layer and kept for the others (the view is the pool's as this step is queued)."""
        if not self._read_pages:
            return None
        if self._pages is None or self._pages[0] is not chunks:
            view = self.paged.storage.page_view()
            self._pages = (chunks, None if view is None else view.pages_for(chunks.block_tables))
        return self._pages[1]

    def _plan(self, window: int | None) -> TorchAttentionPlan:
        """The torch path's plan for this step's rows that read the blocks: the decode rows, and the
        prefill chunks unless none has context and no window narrows them (those attend their own K/V)."""
        plan = self._plans.get(window)
        if plan is not None:
            return plan
        step = self.step
        counts: list[int] = []
        lengths: list[int] = []
        tables: list[list[int]] = []
        if step.decode is not None:
            counts += [1] * step.decode.rows
            lengths += step.decode.seq_lens.tolist()
            tables += step.decode.block_tables.tolist()
        chunks = step.prefill
        if chunks is not None and (chunks.runs is None or window is not None):
            cu = chunks.cu_seq_q.tolist()
            counts += [b - a for a, b in zip(cu, cu[1:])]
            lengths += chunks.seq_lens.tolist()
            tables += chunks.block_tables.tolist()
        kernel_loader.log_choice("paged attention of an engine step",
                                 kernel_loader.KernelChoice(False, "torch, unpadded (torch_varlen.py)"))
        plan = self._plans[window] = plan_torch_attention(self.paged.storage, counts, lengths, tables, window)
        return plan
