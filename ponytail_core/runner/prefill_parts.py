"""Which of a step's prefill chunks attend in one kernel call, and which attend their own K/V apart.

A chunk after cached context (a prompt's second chunk, a prefix hit) reads its keys from the blocks:
on CUDA they are gathered into one packed buffer first (attention/prefill_cupy.py). With one varlen
call per step, every chunk of the step came along into that buffer, the new prompts too, although
their keys were in the model's key tensor already. The copy moves twice a token's K/V bytes a
layer (read, then written): 32 KB on a 7B, ~1 MB a token a step, ~2% of a prefill step there; and a
prompt continued from the step before sits in nearly every step of mixed prompts packed to the budget.

So a run of adjacent chunks without context attends apart, over its own K/V, when it holds at least
TUNABLES["own_kv_min_tokens"] tokens (a second call a layer costs a launch and a partial last wave)
and every call left over the blocks still fills the device: each query tile of its chunks is one
CTA per head, and with fewer than the SMs the device idles while the longest row walks its
context, which the single call hid behind the other chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..utils.arith import cdiv

# own_kv_min_tokens: the fewest tokens of a run without context worth its own call;
# query_tile: the varlen kernels' query rows per CTA (FlashAttention-2/3/4 on Hopper: 128);
# min_tiles: query tiles x heads a call over the blocks needs to stand alone (None: the device's SMs).
TUNABLES: dict[str, int | None] = {"own_kv_min_tokens": 1024, "query_tile": 128, "min_tiles": None}


@dataclass(frozen=True, slots=True)
class PartSpan:
    """Chunks first .. last - 1 of a step's prefill chunks, attended in one call."""

    first: int
    last: int
    own_kv: bool  # none has context: they attend the forward pass's own K/V, nothing gathered


def split_by_context(rows: list[tuple[int, int]], heads: int, sms: int) -> list[PartSpan]:
    """rows: each prefill chunk's (context tokens, new tokens), in packed order. One span of every
    chunk (own_kv when none has context) unless attending runs without context apart pays (see the
    module docstring); then the spans in order, covering every chunk once."""
    if not rows:
        return []
    if all(context == 0 for context, _ in rows):
        return [PartSpan(0, len(rows), True)]
    whole = [PartSpan(0, len(rows), False)]
    own = [(a, b) for a, b in _runs_without_context(rows)
           if sum(new for _, new in rows[a:b]) >= TUNABLES["own_kv_min_tokens"]]
    if not own:
        return whole
    spans: list[PartSpan] = []
    at = 0
    for a, b in own:
        if at < a:
            spans.append(PartSpan(at, a, False))
        spans.append(PartSpan(a, b, True))
        at = b
    if at < len(rows):
        spans.append(PartSpan(at, len(rows), False))
    min_tiles = TUNABLES["min_tiles"] if TUNABLES["min_tiles"] is not None else sms
    tile = TUNABLES["query_tile"]
    for span in spans:
        if not span.own_kv and heads * sum(cdiv(new, tile) for _, new in rows[span.first : span.last]) < min_tiles:
            return whole
    return spans


def _runs_without_context(rows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Maximal [a, b) ranges of adjacent chunks without context."""
    runs = []
    start = None
    for i, (context, _) in enumerate(rows):
        if context == 0 and start is None:
            start = i
        elif context != 0 and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(rows)))
    return runs
