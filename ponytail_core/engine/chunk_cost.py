"""A prefill chunk's share of a step's token budget when its attention is counted too.

A new token costs its linear layers (a fixed amount per token) plus attention over everything
before it (growing with its context). On the CPU the second part is large: one decoder layer of
SmolLM2-135M does 3.5M multiply-adds of linear work per token and 1,152 of attention per cached
token, so at 2k tokens of context a token costs 1.7x what it costs at the start (measured: a
248-token chunk beside 8 decode rows took 0.50 s at context 0 and 0.79 s at 1,792). A plain token
budget lets the late chunks of a long prompt make the slowest steps, which is what the streams
beside them feel. Counting each chunk as tokens x (1 + context_cost x mean context) keeps every
step near the budget's time instead.
"""

from __future__ import annotations

import math


def context_cost(text_config) -> float:
    """Attention work per (new token, cached token) over linear work per new token, one decoder
    layer of a standard transformer (QK^T and PV against q/k/v/o projections and a gated MLP)."""
    hidden = int(text_config.hidden_size)
    heads = int(text_config.num_attention_heads)
    head_dim = int(getattr(text_config, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    intermediate = int(getattr(text_config, "intermediate_size", None) or 4 * hidden)
    linear = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate
    return 2 * heads * head_dim / linear


def chunk_cost(tokens: int, start: int, cost: float) -> int:
    """Budget a chunk of `tokens` new tokens after `start` cached ones takes (whole tokens)."""
    return math.ceil(tokens * (1 + cost * (start + tokens / 2)))


def chunk_tokens(want: int, start: int, budget: int, cost: float) -> int:
    """The most of `want` tokens after `start` cached ones whose chunk_cost fits `budget`; at least
    one while budget > 0, so a chunk over any context still moves on."""
    if budget <= 0:
        return 0
    if cost == 0:
        return min(want, budget)
    b = 1 + cost * start  # solve cost/2 n^2 + b n = budget for n
    n = int((math.sqrt(b * b + 2 * cost * budget) - b) / cost)
    while n > 0 and chunk_cost(n, start, cost) > budget:  # float rounding, and ceil in chunk_cost
        n -= 1
    while n < want and chunk_cost(n + 1, start, cost) <= budget:  # rounding the other way (an exact fit)
        n += 1
    return max(1, min(want, n))
