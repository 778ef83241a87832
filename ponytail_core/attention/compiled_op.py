"""Ponytail's attention as a torch custom op, so that a compiled decoder layer traces as one graph.

A compiled layer that calls the attention eagerly (behind torch.compiler.disable) breaks its graph
there, and so does the cache's update() (it tags a tensor): TorchDynamo resumes the rest of the
layer and of its attention module in frames of their own, each with its cache lookup, guards and
compiled-graph wrapper: 7 a layer, which were the bulk of a small model's eager step's host time
(docs/benchmarks.md). vLLM calls its attention through a custom op (torch.ops.vllm.unified_attention) for the
same reason; so does a compiled layer here: `ponytail::attention(query, key, value, mask, scale,
sliding_window)` is an op like any other in the layer's graph, and runs the step cache's attend.

Neither the cache nor the layer's index is an argument (an op takes tensors and scalars, and an
int would be traced as a constant, one graph per layer): the compiled layer's wrapper
(runner/compile.py) names them for the call (`calling`), as vLLM's forward context does. The op
writes the KV pool, which nothing in the graph reads; its output feeds the rest of the layer, so
the graph neither drops nor reorders it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

COMPILED_CALL = "ponytail_compiled_call"  # kwarg the wrapper passes down to the attention function


@dataclass(slots=True)
class LayerCall:
    """What the op needs besides its tensors: the cache, the layer's attention module and index."""

    cache: object  # a PagedCacheBase
    module: torch.nn.Module
    layer_idx: int


_current: LayerCall | None = None


@contextlib.contextmanager
def calling(cache, module: torch.nn.Module, layer_idx: int):
    """The layer call the op inside runs for (one compiled layer's forward)."""
    global _current
    previous, _current = _current, LayerCall(cache, module, layer_idx)
    try:
        yield
    finally:
        _current = previous


@torch.library.custom_op("ponytail::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float, sliding_window: int | None) -> torch.Tensor:
    """query [B, Hq, T, D], key/value [B, Hkv, T, D] (this step's tokens) -> [B, T, Hq, D]: this
    layer's new K/V written into the cache, attention over the context read from its blocks."""
    call = _current
    if call is None:
        raise RuntimeError("ponytail::attention runs inside a compiled layer's call (runner/compile.py), "
                           "which names the cache and the layer; none is active")
    out = call.cache.attend_or_abandon(call.layer_idx, call.module, query, key, value, mask, scale, sliding_window)
    return out.contiguous()  # the strides the fake below promises


@attention.register_fake
def _(query, key, value, mask, scale, sliding_window):
    batch, heads, tokens, head_dim = query.shape
    return query.new_empty((batch, tokens, heads, head_dim))
