"""Attention of prefill chunks without context: each chunk over its own new K/V.

A chunk that starts its sequence (a new prompt without a prefix hit, or a recompute after
preemption) attends only tokens of the same forward pass. Their K/V are in the model's key/value
tensors already, so reading them back from the blocks would only add a gather. Runs of adjacent
chunks of one length go to torch SDPA as one dense [rows, heads, length, D] batch made of strided
views (no copies); on Hopper that is cuDNN's kernel, faster than flash varlen for such batches
(docs/benchmarks.md). When the lengths are too varied for a few SDPA calls, one flash varlen call
takes every chunk instead, still without touching the blocks.

cuDNN builds an execution plan for every new SDPA shape, tens of milliseconds against a fraction
of one for the call itself. A server sees ever new chunk lengths, and paying that
inside a step stalls every request in it; so SDPA takes only runs whose (rows, length) came up
PLAN_AFTER times before (SdpaShapes, per engine), and flash varlen, which has no plans, the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .flash import flash_problem, flash_varlen

logger = logging.getLogger("ponytail.kernels")

# SDPA calls per layer before one flash varlen call is cheaper (each call costs ~10 us of host time).
MAX_SDPA_RUNS = 4
# A run shape seen this often before recurs: building its cuDNN plan once pays off.
PLAN_AFTER = 2


@dataclass(frozen=True, slots=True)
class ChunkRun:
    """Adjacent chunks of one length: packed tokens start .. start + rows * length - 1."""

    start: int
    rows: int
    length: int


def equal_length_runs(lengths: list[int]) -> list[ChunkRun]:
    """Group adjacent chunk lengths into runs, e.g. [4, 4, 2] -> (0, 2 x 4), (8, 1 x 2)."""
    runs: list[ChunkRun] = []
    start = 0
    for length in lengths:
        if length < 1:
            raise ValueError(f"chunk lengths must be positive, got {lengths}")
        last = runs[-1] if runs else None
        if last is not None and last.length == length:
            runs[-1] = ChunkRun(last.start, last.rows + 1, length)
        else:
            runs.append(ChunkRun(start, 1, length))
        start += length
    return runs


class SdpaShapes:
    """How often each run shape (rows, length) came up: SDPA only for shapes that recur.

    One count per step (not per layer). Forgets everything past `limit` shapes, so a server's
    endless new lengths cannot grow it without bound.
    """

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self._counts: dict[tuple[int, int], int] = {}

    def recurring(self, runs: list[ChunkRun]) -> bool:
        """Counts this step's shapes; True when every one was seen PLAN_AFTER times before."""
        counts = self._counts
        if len(counts) + len(runs) > self.limit:
            counts.clear()
        ready = True
        for run in runs:
            shape = (run.rows, run.length)
            seen = counts.get(shape, 0)
            ready &= seen >= PLAN_AFTER
            counts[shape] = seen + 1
        return ready


def attention_over_new_tokens(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, runs: list[ChunkRun],
                              cu_seq_q: torch.Tensor, max_query_len: int, scale: float,
                              out: torch.Tensor | None = None, sdpa: bool = True,
                              varlen: str = "flash", window: int | None = None) -> torch.Tensor:
    """Causal attention of packed chunks over themselves.

    query [Hq, N, D] and key/value [Hkv, N, D]: the chunks' tokens end to end along N, as views
    of the model's tensors (any strides with a contiguous last dim). runs covers the N tokens;
    cu_seq_q [chunks + 1] int32 holds the same boundaries on the device. Query heads h use KV
    head h // (Hq // Hkv). Returns [N, Hq, D], written into `out` when given (contiguous). sdpa=False: flash
    varlen where it can (the run shapes are new, see SdpaShapes), SDPA only where it cannot.
    varlen: the varlen kernel, "flash" or "fa4" (fa4.choose_prefill_attention). window: a sliding
    window; where it leaves keys out, flash varlen takes it where flash runs, else SDPA with a mask.
    """
    heads, tokens, head_dim = query.shape
    if key.shape[1] != tokens or value.shape != key.shape or heads % key.shape[0]:
        raise ValueError(f"query {tuple(query.shape)} and key/value {tuple(key.shape)} / {tuple(value.shape)} "
                         "must be [heads, tokens, head_dim] with the same tokens and Hq a multiple of Hkv")
    if sum(r.rows * r.length for r in runs) != tokens:
        raise ValueError(f"runs {runs} cover {sum(r.rows * r.length for r in runs)} tokens, query has {tokens}")
    narrowed = window is not None and window < max_query_len
    if (len(runs) > MAX_SDPA_RUNS or not sdpa or narrowed) and flash_problem(query.device, query.dtype,
                                                                             head_dim) is None:
        why = "runs in a sliding window" if narrowed else "new shapes" if len(runs) <= MAX_SDPA_RUNS else \
            "distinct runs of lengths"
        _log(f"{varlen} varlen over the chunks' own K/V ({len(runs)} {why})")
        return flash_varlen(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), cu_seq_q,
                            cu_seq_q, max_query_len, max_query_len, scale, kernel=varlen, out=out,
                            window=window if narrowed else None)
    _log(f"torch SDPA over the chunks' own K/V, one call per run of equal lengths ({len(runs)} runs)")
    if out is None:
        out = torch.empty((tokens, heads, head_dim), dtype=query.dtype, device=query.device)
    gqa = heads != key.shape[0]
    for run in runs:
        end = run.start + run.rows * run.length

        def rows_view(t: torch.Tensor) -> torch.Tensor:  # [H, n * L, D] -> [n, H, L, D], a view
            return t[:, run.start : end].unflatten(1, (run.rows, run.length)).transpose(0, 1)

        mask = None
        if window is not None and window < run.length:  # causal within the window: key j in (i - window, i]
            mask = torch.ones(run.length, run.length, dtype=torch.bool, device=query.device).tril_().triu_(1 - window)
        o = F.scaled_dot_product_attention(rows_view(query), rows_view(key), rows_view(value), attn_mask=mask,
                                           is_causal=mask is None, scale=scale, enable_gqa=gqa)
        out[run.start : end].view(run.rows, run.length, heads, head_dim).copy_(o.transpose(1, 2))
    return out


_logged: set[str] = set()


def _log(message: str) -> None:
    key = message.split(" (")[0]
    if key not in _logged:
        _logged.add(key)
        logger.info("prefill without context: %s", message)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("prefill without context: %s", message)
