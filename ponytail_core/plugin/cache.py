"""A transformers `Cache` backed by Ponytail's paged pool, for `model.generate(..., cache=cache)`.

Each batch row is one sequence in the pool. The cache does not hand full K/V back to the model:
`update()` only tags the new tokens' K/V with the cache (attention/hf_cache_base.py), and
Ponytail's attention function (registered as attn_implementation "ponytail", see
attention/hf_backend.py) writes them into their slots and reads the context straight from the
blocks. Left padding is never stored: a padded row simply holds fewer tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention.hf_cache_base import PagedCacheBase
from ..attention.paged import paged_attention
from ..errors import ConfigError
from ..kv.config import CacheConfig
from ..kv.paged_cache import PagedKVCache
from ..utils.device import to_device


@dataclass(slots=True)
class StepMetadata:
    """What every layer of one forward pass needs; built once, at layer 0."""

    query_len: int  # T: new positions per row, padding included
    slot_mapping: torch.Tensor  # [B * T] int64, -1 for padding positions
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: tokens each row holds after this step
    query_lens: torch.Tensor  # [B] int32: real (non-padding) new tokens per row
    new_valid: torch.Tensor | None  # [B, T] bool: which new positions are real (None: all)
    has_context: bool  # whether any row held tokens before this step


class PonytailCache(PagedCacheBase):
    """The object `ponytail.create_cache` returns: hand it to `model.generate` as `cache=`.

    `paged` is the underlying `PagedKVCache` (stats, maintenance, direct block access).
    """

    def __init__(self, config: CacheConfig):
        # The plug-in addresses rows by position, never by content: no prefix hashing.
        super().__init__(PagedKVCache(config, enable_prefix_caching=False))
        self.seen_tokens = 0
        self.step: StepMetadata | None = None
        self._rows = 0
        # Per row, the positions it holds; fewer than its slots after crop() (assisted decoding), whose
        # forgotten slots the next tokens take again. _shared: rows were forked (beams share blocks).
        self._lengths: list[int] = []
        self._shared = False
        self._mid_step = False  # slots were taken for a forward pass that has not finished

    def stats(self):
        return self.paged.stats()

    @property
    def batch_size(self) -> int:
        return self._rows or -1

    def reset(self) -> None:
        """Forget every row (the pool keeps its memory for the next generate call)."""
        for row in range(self._rows):
            self.paged.free(row)
        self._rows, self.seen_tokens, self.step, self._lengths, self._shared = 0, 0, None, [], False
        self._awaiting_attention, self._mid_step = None, False

    # -------------------------------------------- beam search, repeated and selected rows
    def reorder_cache(self, beam_idx) -> None:
        """Beam search: row i continues what row beam_idx[i] held. Rows share blocks (ref counts,
        nothing copied); a shared partial last block is copied when a row next writes to it."""
        self._select_rows(beam_idx, "beam_idx")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes `repeats` rows in a row (num_return_sequences over a filled cache)."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ConfigError(f"repeats={repeats!r} is not supported; allowed: an integer >= 1")
        self._select_rows([row for row in range(self._rows) for _ in range(repeats)], "repeats")

    def batch_select_indices(self, indices) -> None:
        """Keep the rows `indices` names, in that order."""
        self._select_rows(indices, "indices")

    def _select_rows(self, order, name: str) -> None:
        order = [int(i) for i in (order.tolist() if isinstance(order, torch.Tensor) else order)]
        if self._mid_step:
            raise ConfigError(f"{name}: rows cannot be rearranged in the middle of a forward pass")
        bad = [i for i in order if not 0 <= i < self._rows]
        if bad or not order:
            raise ConfigError(f"{name}={order[:8]}{'...' if len(order) > 8 else ''} is not supported; allowed: "
                              f"row numbers in [0, {self._rows}) of the cache's {self._rows} rows, at least one")
        if len(order) > self.config.max_batch_size:
            raise ConfigError(f"{name} asks for {len(order)} rows; the cache's max_batch_size is "
                              f"{self.config.max_batch_size}: raise it in create_cache")
        if order == list(range(self._rows)):
            return
        if any(self.paged.seq_len(row) != self._lengths[row] for row in range(self._rows)):
            raise NotImplementedError(f"{name}: rows cut back by assisted decoding (crop) cannot be rearranged")
        staged = [("staged", row) for row in range(len(order))]
        for row, source in zip(staged, order):
            self.paged.fork(source, row)
        for row in range(self._rows):
            self.paged.free(row)
        for row, source in enumerate(staged):  # back under the row numbers the model's batch uses
            self.paged.fork(source, row)
            self.paged.free(source)
        self._rows, self._lengths, self._shared = len(order), [self._lengths[i] for i in order], True

    @property
    def is_croppable(self) -> bool:  # transformers asks before assisted decoding
        return not self._shared

    def crop(self, tokens_to_remove: int) -> None:
        """Assisted decoding: every row forgets its last -tokens_to_remove positions (candidates the
        model did not accept). Their slots stay the row's; the next tokens are written into them."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
            raise ConfigError(f"tokens_to_remove={tokens_to_remove!r} is not supported; allowed: 0 or a negative "
                              "integer, minus the number of last positions to forget (transformers' crop)")
        forget = -tokens_to_remove
        if forget == 0:
            return
        if self._mid_step or forget > min(self._lengths, default=0):
            raise ConfigError(f"tokens_to_remove={tokens_to_remove} asks to forget more than the rows hold "
                              f"({min(self._lengths, default=0)} positions) or came in the middle of a forward pass")
        if self._shared:
            raise NotImplementedError("assisted decoding (crop) after rows were forked (beam search, repeated "
                                      "rows) is not supported by the Ponytail cache yet")
        self.seen_tokens -= forget
        self._lengths = [length - forget for length in self._lengths]

    def attend(self, layer_idx, module, query, key, value, attention_mask, scale, sliding_window):
        batch, _, query_len, _ = query.shape
        if layer_idx == 0:
            self.check_model(module, query, key, sliding_window)
            self.begin_step(batch, query_len, attention_mask)
        step = self.step
        window = self.window(sliding_window)
        self.write_new_kv(layer_idx, key, value, step.slot_mapping)
        if step.has_context:
            out = paged_attention(self.paged.storage, layer_idx, query, step.block_tables, step.seq_lens,
                                  step.query_lens, scale, sliding_window=window)
        else:  # first chunk: the new tokens are the whole context, no need to read the blocks back
            out = attention_without_context(query, key, value, step.new_valid, scale, window)
        self.end_layer(layer_idx)
        return out.transpose(1, 2).contiguous()

    def begin_step(self, batch: int, query_len: int, attention_mask: torch.Tensor | None) -> StepMetadata:
        """Take slots for this forward pass's real tokens (layer 0 only); refuses what cannot fit."""
        c = self.config
        if self._rows == 0:
            if batch > c.max_batch_size:
                raise ConfigError(f"batch of {batch} rows exceeds the cache's max_batch_size={c.max_batch_size}")
            self._rows = batch
        elif batch != self._rows:
            raise ConfigError(f"the cache holds {self._rows} rows but this call has {batch}; "
                              "call cache.reset() between generate calls with different batches")
        if self.seen_tokens + query_len > c.max_seq_len:
            raise ConfigError(f"{self.seen_tokens} cached + {query_len} new positions exceed the cache's "
                              f"max_seq_len={c.max_seq_len}")
        new_valid = None
        if attention_mask is not None:
            new_valid = attention_mask[:, -query_len:].to(torch.bool)
        counts = [query_len] * batch if new_valid is None else new_valid.sum(dim=1).tolist()
        has_context = self.seen_tokens > 0
        slots: list[int] = []
        if not self._lengths:
            self._lengths = [0] * batch
        for row, count in enumerate(counts):
            length, fresh = self._lengths[row], not self.paged.has_seq(row)
            # Slots crop() left behind first, then new ones; token ids matter only for prefix hashing (off here).
            reuse = 0 if fresh else min(count, self.paged.seq_len(row) - length)
            row_slots = self.paged.slots(row, length, length + reuse) if reuse else []
            if fresh or count > reuse:
                placeholder = [0] * (count - reuse)
                result = self.paged.allocate(row, placeholder) if fresh else self.paged.append(row, placeholder)
                if not result:
                    raise ConfigError(f"the cache is full: {result.message}; raise max_batch_size, "
                                      "max_seq_len or memory_budget in create_cache")
                row_slots += result.slots
            self._lengths[row] = length + count
            slots.extend([-1] * (query_len - count) + row_slots)
        device = c.device
        tables = [self.paged.block_table(row) for row in range(batch)]
        width = max(1, max(len(t) for t in tables))
        table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        lens = torch.tensor(self._lengths, dtype=torch.int32)
        self.step = StepMetadata(
            query_len=query_len,
            slot_mapping=to_device(torch.tensor(slots, dtype=torch.int64), device),
            block_tables=to_device(table_tensor, device),
            seq_lens=to_device(lens, device),
            query_lens=to_device(torch.tensor(counts, dtype=torch.int32), device),
            new_valid=new_valid, has_context=has_context)
        self._mid_step = True
        return self.step

    def end_layer(self, layer_idx: int) -> None:
        self._awaiting_attention = None
        if layer_idx == self.config.num_layers - 1:
            self.seen_tokens += self.step.query_len
            self._mid_step = False

    def abandon_step(self) -> None:
        """A forward pass failed. Before slots were taken nothing changed; after, the rows hold a
        partial step, so they are dropped (their blocks go back to the pool, none leak)."""
        self._awaiting_attention = None
        if self._mid_step:
            self.reset()


def attention_without_context(query, key, value, new_valid, scale, window: int | None = None) -> torch.Tensor:
    """Causal attention of a first chunk over itself, [B, Hq, T, D]; padding rows come out zero.
    window: each query sees only the last that many positions up to its own."""
    gqa = query.shape[1] != key.shape[1]
    t = query.shape[2]
    narrowed = window is not None and window < t
    if new_valid is None and not narrowed:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=gqa)
    causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()
    if narrowed:
        causal.triu_(1 - window)  # key j > query i - window (left padding shifts both alike)
    if new_valid is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=causal, scale=scale, enable_gqa=gqa)
    mask = causal & new_valid[:, None, None, :]
    # A padding query sees no real key; let it see itself so softmax stays finite, then zero it.
    mask |= torch.eye(t, dtype=torch.bool, device=query.device)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out * new_valid[:, None, :, None].to(out.dtype)
