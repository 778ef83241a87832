"""Paged attention of mixed rows (decode rows, prefill chunks with or without context) in torch, unpadded.

The CPU path (and PONYTAIL_KERNELS=torch). Work and memory grow with each row's query tokens
times its context, never with rows x the longest row:
  * one gather per KV chunk copies every row's blocks, and only those, end to end;
  * a row with several query tokens runs torch SDPA on views of its own K/V; when it has context
    the bottom-right causal mask is [its tokens, its context + tokens], nothing wider;
  * rows with one query token (decode) are batched: each is padded to a width its own length
    alone decides (`decode_width`: 1, 2, 3, 4, 6, 8, 12, ... blocks, at most a third wasted) and
    rows of one width share one SDPA with a key mask [rows, 1, 1, width]. A row's numbers then
    never depend on which rows share its step (the sync and async engines agree bit for bit);
  * a sliding window (Mistral, Gemma 3's local layers) narrows both: a row gathers the blocks
    from its first query's window start on, and its mask drops the keys each query cannot see.

`plan_torch_attention` reads the lengths once on the host (a forward pass calls it once, every
layer reuses the plan); `attention_torch_planned` runs one layer. `SlotWrites` does the same for
writing a step's new K/V: the slots' chunks are sorted out once, not per layer. Same semantics as
paged.paged_attention_varlen: row b's queries are the last of its seq_lens[b] cached tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kv.scales import dequantize, indexable, quantize
from ..kv.storage import PagedKVStorage


def decode_width(length: int, block_size: int) -> int:
    """Tokens a decode row of `length` is padded to: the next of 1, 2, 3, 4, 6, 8, 12, 16, ... blocks.

    Few widths, so few SDPA calls; never more than a third of a row wasted past its last block."""
    blocks = -(-length // block_size)
    width = 1 << (blocks - 1).bit_length()  # the next power of two
    if width >= 4 and blocks <= width * 3 // 4:
        width = width * 3 // 4
    return width * block_size


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Rows with one query token each, padded to the same key width."""

    rows: torch.Tensor  # [g] int64: the rows' query token indexes (packed positions)
    key_start: int  # first token of the group in the gathered buffer; row i at key_start + i * width
    width: int  # tokens per row, a multiple of block_size
    mask: torch.Tensor  # [g, 1, 1, width] bool: key is real


@dataclass(frozen=True, slots=True)
class ChunkRow:
    """A row with several query tokens: the last `tokens` of its `length` cached tokens."""

    query_start: int  # its first query token (packed position)
    tokens: int
    key_start: int  # its first token in the gathered buffer
    length: int
    mask: torch.Tensor | None  # [tokens, length] bool, bottom-right causal (None: tokens == length)


@dataclass(frozen=True, slots=True)
class TorchAttentionPlan:
    """Everything one step's layers share: which blocks to gather and how rows sit in the result."""

    gathers: list[tuple[int, torch.Tensor, torch.Tensor]]  # (KV chunk, block ids in it, where they go)
    num_blocks: int  # blocks in the gathered buffer (each row's, decode rows padded)
    dead: torch.Tensor | None  # gathered token positions to zero: padding and tails of decode rows
    decode: list[DecodeGroup]
    chunks: list[ChunkRow]
    empty: torch.Tensor | None  # query tokens of rows without keys: their output is zero
    num_tokens: int  # query tokens in all


def plan_torch_attention(storage: PagedKVStorage, query_counts: list[int], seq_lens: list[int],
                         tables: list[list[int]], window: int | None = None) -> TorchAttentionPlan:
    """The plan for rows with query_counts[b] new tokens among seq_lens[b] cached ones in tables[b].

    window: a sliding window (each query sees the last `window` positions up to its own, as
    transformers' sliding layers do); a row then gathers only the blocks its queries can see."""
    bs = storage.config.block_size
    device = storage.device
    starts = [0]
    for count in query_counts:
        starts.append(starts[-1] + count)
    ids: list[int] = []  # block ids in gathered order
    dead: list[int] = []
    # Where each row's gathered keys start: its first query's window start, rounded down to a block.
    first = [_first_block(n - count, window, bs) for count, n in zip(query_counts, seq_lens)]
    widths: dict[int, list[int]] = {}  # decode rows by padded width, in row order
    for b, count in enumerate(query_counts):
        if count == 1 and seq_lens[b] > 0:
            widths.setdefault(decode_width(seq_lens[b] - first[b] * bs, bs), []).append(b)
    decode: list[DecodeGroup] = []
    for width, members in sorted(widths.items()):
        key_start = len(ids) * bs
        for b in members:
            blocks = tables[b][first[b] : -(-seq_lens[b] // bs)]
            row_start = len(ids) * bs
            ids.extend(blocks + [blocks[0]] * (width // bs - len(blocks)))  # any block the row owns: masked
            dead.extend(range(row_start + seq_lens[b] - first[b] * bs, row_start + width))
        lens = torch.tensor([seq_lens[b] - first[b] * bs for b in members])
        # Always a mask, even when every row fills the width: SDPA rounds differently without one,
        # and a row's result must not depend on its neighbours.
        keys = torch.arange(width)[None, :]
        mask = keys < lens[:, None]
        if window is not None:
            mask &= keys >= lens[:, None] - window
        decode.append(DecodeGroup(torch.tensor([starts[b] for b in members], device=device), key_start, width,
                                  mask.view(len(members), 1, 1, width).to(device)))
    chunks: list[ChunkRow] = []
    empty: list[int] = []
    for b, count in enumerate(query_counts):
        n = seq_lens[b]
        if count == 0 or (count == 1 and n > 0):
            continue
        if n == 0:
            empty.extend(range(starts[b], starts[b] + count))
            continue
        key_start = len(ids) * bs
        ids.extend(tables[b][first[b] : -(-n // bs)])
        offset = first[b] * bs
        chunks.append(ChunkRow(starts[b], count, key_start, n - offset, _chunk_mask(count, n, offset, window, device)))
    return TorchAttentionPlan(gathers=_gathers(storage, ids), num_blocks=len(ids),
                              dead=torch.tensor(dead, device=device) if dead else None, decode=decode,
                              chunks=chunks, empty=torch.tensor(empty, device=device) if empty else None,
                              num_tokens=starts[-1])


def _first_block(first_query: int, window: int | None, block_size: int) -> int:
    """The first block a row's queries can see: 0, or where the first query's window starts."""
    if window is None:
        return 0
    return max(0, first_query - window + 1) // block_size


def _chunk_mask(count: int, n: int, offset: int, window: int | None, device) -> torch.Tensor | None:
    """[count, n - offset] bool: the row's last `count` queries against its keys from cache position
    `offset` on; None where plain causal attention over all n keys is the answer."""
    if window is None or window >= n:
        if count == n:
            return None
        # query i sits at cache position n - count + i and sees keys up to it
        return torch.ones((count, n), dtype=torch.bool, device=device).tril_(n - count)
    queries = torch.arange(n - count, n, device=device)[:, None]
    keys = torch.arange(offset, n, device=device)[None, :]
    return (keys <= queries) & (keys > queries - window)


def _gathers(storage: PagedKVStorage, ids: list[int]) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    if not ids:
        return []
    block_ids = torch.tensor(ids, dtype=torch.int64)
    chunk_of, within = storage.locate(block_ids)
    if int(chunk_of.max()) == int(chunk_of.min()):  # one chunk: the gather writes every block in order
        return [(int(chunk_of[0]), within.to(storage.device), None)]
    out = []
    for chunk in torch.unique(chunk_of).tolist():
        where = (chunk_of == chunk).nonzero().flatten()
        out.append((chunk, within[where].to(storage.device), where.to(storage.device)))
    return out


def gather_planned(storage: PagedKVStorage, layer: int, plan: TorchAttentionPlan) -> torch.Tensor:
    """[2, plan.num_blocks * block_size, kv_heads, head_dim]: K and V of the plan's blocks in order."""
    c = storage.config
    if len(plan.gathers) == 1 and plan.gathers[0][2] is None:
        chunk, within, _ = plan.gathers[0]
        kv = storage.chunks[chunk][layer].index_select(1, within)
    else:
        kv = torch.empty((2, plan.num_blocks, c.block_size, c.num_kv_heads, c.head_dim), dtype=c.kv_dtype,
                         device=storage.device)
        for chunk, within, where in plan.gathers:
            indexable(kv).index_copy_(1, where, indexable(storage.chunks[chunk][layer]).index_select(1, within))
    kv = kv.flatten(1, 2)
    if storage.scales is not None:
        kv = dequantize(kv, storage.scales.values[layer, :, None, None, None], c.dtype)
    if plan.dead is not None:  # never read uninitialised memory into a softmax, even masked (NaN * 0)
        kv.index_fill_(1, plan.dead, 0)
    return kv


def attention_torch_planned(storage: PagedKVStorage, layer: int, query: torch.Tensor, plan: TorchAttentionPlan,
                            scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Packed queries [N, Hq, D] over layer `layer` as the plan lays them out; returns [N, Hq, D]."""
    tokens, heads, head_dim = query.shape
    if tokens != plan.num_tokens:
        raise ValueError(f"query has {tokens} tokens, the plan {plan.num_tokens}")
    if out is None:
        out = torch.empty_like(query)
    kv = gather_planned(storage, layer, plan)
    keys, values = kv[0], kv[1]  # [tokens, Hkv, D]
    gqa = heads != storage.config.num_kv_heads
    for group in plan.decode:
        g = group.rows.shape[0]
        end = group.key_start + g * group.width

        def rows_view(t: torch.Tensor) -> torch.Tensor:  # [g * width, H, D] -> [g, H, width, D], a view
            return t[group.key_start : end].unflatten(0, (g, group.width)).transpose(1, 2)

        q = query.index_select(0, group.rows)[:, :, None]  # [g, Hq, 1, D]
        o = F.scaled_dot_product_attention(q, rows_view(keys), rows_view(values), attn_mask=group.mask,
                                           scale=scale, enable_gqa=gqa)
        out.index_copy_(0, group.rows, o[:, :, 0])
    for row in plan.chunks:
        q = query[row.query_start : row.query_start + row.tokens].transpose(0, 1)[None]  # [1, Hq, T, D]
        k = keys[row.key_start : row.key_start + row.length].transpose(0, 1)[None]
        v = values[row.key_start : row.key_start + row.length].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=row.mask, is_causal=row.mask is None, scale=scale,
                                           enable_gqa=gqa)
        out[row.query_start : row.query_start + row.tokens] = o[0].transpose(0, 1)
    if plan.empty is not None:
        out.index_fill_(0, plan.empty, 0)
    return out


class SlotWrites:
    """A step's K/V writes on the torch path, sorted by KV chunk once and replayed for every layer.

    cache_ops.write_slots finds each token's chunk again on every call (a few small ops per chunk
    per layer); a CPU step through a 30-layer model would pay that 30 times.
    """

    def __init__(self, storage: PagedKVStorage, slot_mapping: torch.Tensor):
        c = storage.config
        self.storage = storage
        slots = self.slots = slot_mapping.to(torch.int64)
        valid = slots >= 0
        chunk_of = torch.div(slots, c.block_size * storage.chunk_blocks, rounding_mode="floor")
        local = slots - chunk_of * (c.block_size * storage.chunk_blocks)  # token index within its chunk
        self.writes: list[tuple[int, torch.Tensor | None, torch.Tensor]] = []  # (chunk, packed tokens, local)
        if bool(valid.all()) and (slots.numel() == 0 or int(chunk_of.min()) == int(chunk_of.max())):
            if slots.numel():
                self.writes.append((int(chunk_of[0]), None, local))
            return
        for chunk in torch.unique(chunk_of[valid]).tolist():
            where = (valid & (chunk_of == chunk)).nonzero().flatten()
            self.writes.append((chunk, where, local[where]))

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """key/value [tokens, kv_heads, head_dim] (any token stride) into layer `layer`."""
        c = self.storage.config
        scales = self.storage.scales
        if scales is not None:
            if scales.calculating:
                scales.observe(layer, key[None], value[None], self.slots)
            key, value = quantize(key, scales.values[layer, 0]), quantize(value, scales.values[layer, 1])
        for chunk, where, local in self.writes:
            tokens = indexable(self.storage.chunks[chunk][layer]).view(2, -1, c.num_kv_heads, c.head_dim)
            tokens[0].index_copy_(0, local, indexable(key if where is None else key.index_select(0, where)))
            tokens[1].index_copy_(0, local, indexable(value if where is None else value.index_select(0, where)))
