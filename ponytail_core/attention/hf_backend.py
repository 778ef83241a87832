"""Ponytail as a transformers attention implementation ("ponytail").

Registered with transformers' `AttentionInterface` (the attention function) and
`AttentionMaskInterface` (the mask it wants: the 2-D padding mask, or None without padding), so
stock models use it without code changes once `model.set_attn_implementation("ponytail")` ran;
`ponytail.create_cache(model=model)` does that.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

from . import compiled_op, hf_fallback
from .hf_cache_base import LAYER_INDEX_ATTR, TAG

ATTN_IMPLEMENTATION = "ponytail"


def ponytail_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None,
                               dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """query [B, Hq, T, D], key/value [B, Hkv, T, D] (this step's tokens only) -> [B, T, Hq, D]."""
    owner = getattr(key, TAG, None)
    if owner is None:  # no Ponytail cache: the model runs as it did before create_cache
        return hf_fallback.run_previous(module, query, key, value, attention_mask, dropout=dropout,
                                        scaling=scaling, **kwargs)
    cache, layer_idx = owner
    # A compiled layer passes layer_idx 0 to the cache (runner/compile.py: one trace for every
    # layer); its attention module holds the real index here.
    layer_idx = vars(module).get(LAYER_INDEX_ATTR, layer_idx)  # no nn.Module __getattr__ miss per call
    out = cache.attend_or_abandon(layer_idx, module, query, key, value, hf_fallback.padding_mask(attention_mask),
                                  _scale(query, scaling, kwargs), kwargs.get("sliding_window"))
    return out, None


def _scale(query: torch.Tensor, scaling: float | None, kwargs: dict) -> float:
    """The softmax scale transformers asked for (1/sqrt(head_dim) unset). Refuses what would change
    the softmax and the kernels do not do, rather than answer wrongly: softcapping (Gemma 2) and
    attention sinks (gpt-oss's `s_aux`)."""
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("Ponytail attention does not support attention softcapping (Gemma 2) yet")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("Ponytail attention does not support attention sinks (s_aux, gpt-oss) yet")
    return scaling if scaling is not None else query.shape[-1] ** -0.5


_eager_in_compiled_models = torch.compiler.disable(ponytail_attention_forward)


def compiled_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None,
                               dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """The attention function of compiled layers (runner/compile.py). Called by the wrapper of a
    layer with a Ponytail cache (which passes COMPILED_CALL), the graph calls the custom op
    (compiled_op.py) and does not break; any other call breaks the graph and runs as eager models do."""
    if not kwargs.get(compiled_op.COMPILED_CALL):
        return _eager_in_compiled_models(module, query, key, value, attention_mask, dropout=dropout,
                                         scaling=scaling, **kwargs)
    out = torch.ops.ponytail.attention(query, key, value, hf_fallback.padding_mask(attention_mask),
                                       _scale(query, scaling, kwargs), kwargs.get("sliding_window"))
    return out, None


def register(for_compiled_models: bool = False) -> None:
    """Make "ponytail" a valid attn_implementation (idempotent).

    for_compiled_models: register compiled_attention_forward, which a compiled layer traces into
    (compile.py) to call the custom op, and which otherwise runs Ponytail's kernels eagerly behind
    torch.compiler.disable instead of tracing into CuPy. Eager models keep the plain function (no
    wrapper in the hot path)."""
    forward = compiled_attention_forward if for_compiled_models else ponytail_attention_forward
    AttentionInterface.register(ATTN_IMPLEMENTATION, forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, hf_fallback.wrap_mask(flash_attention_mask))


def switch_model(model, keep_fallback: bool = True) -> None:
    """Give `model` attn_implementation "ponytail"; with keep_fallback, calls without a Ponytail
    cache still run its previous implementation (hf_fallback.py)."""
    hf_fallback.switch_to_ponytail(model, ATTN_IMPLEMENTATION, keep_fallback=keep_fallback)


register()
