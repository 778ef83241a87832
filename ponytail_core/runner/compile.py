"""torch.compile of a stock model's decoder layers around Ponytail's attention call.

A decode step of a stock transformers model runs ~45 small kernels per layer (RMSNorm in fp32,
rotary embedding, residual adds, SiLU * up) around its few GEMMs; a CUDA graph removes their
launch cost but not their own time. Compiling each decoder layer lets inductor fuse them. The
attention runs as a custom op (attention/compiled_op.py) the layer's graph calls without breaking,
so Ponytail's kernels and their checks run exactly as without compiling, and each layer is one
compiled graph. Llama-family layers leave their closing residual add to the next layer's norm
(residual_handoff.py), as vLLM's fused add + RMSNorm does.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from ..attention import compiled_op
from ..attention.hf_cache_base import LAYER_INDEX_ATTR, PagedCacheBase
from ..errors import ConfigError
from . import residual_handoff

logger = logging.getLogger("ponytail.engine")

# Every layer shares one code object, so every layer can share its compiled entries (a static
# batch-1 graph, a dynamic one, prefill steps) if nothing the trace reads differs between layers.
# One int does: the `layer_idx` each layer's attention passes to the cache, on which dynamo
# specializes. compile_decoder_layers moves it to LAYER_INDEX_ATTR, which only Ponytail's attention
# reads (outside the trace, hf_backend.py), and leaves the traced attribute at 0 in every layer:
# one trace serves them all. On the CPU with 24 layers: 54 compiles and 53.7 s before, 8 and 30.5 s
# after; the dynamo cache no longer holds one entry per layer for each call to look through.
# Layers that still differ in what the trace reads (a sliding window on some of them) get their own.
_CACHE_SIZE_PER_LAYER = 8


def decoder_layers(model, wanted_by: str = "compile_model=True") -> torch.nn.ModuleList:
    """The decoder's layers; wanted_by names the setting that needs them in the error."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ConfigError(f"{wanted_by} needs a decoder with a `layers` list; {type(model).__name__} "
                          "has none (supported: Llama, Mistral, Qwen2/Qwen3 and similar)")
    return layers


def can_compile(model) -> bool:
    """Whether compile_decoder_layers supports this model (a decoder with a `layers` list)."""
    try:
        decoder_layers(model)
    except ConfigError:
        return False
    return True


def compile_decoder_layers(model) -> int:
    """Compile every decoder layer's forward in place (dynamic batch sizes); returns how many.

    The model object is changed (each layer's `forward` becomes the compiled one) until
    restore_decoder_layers(model)."""
    from ..attention import hf_backend as hf_attention

    layers = decoder_layers(model)
    hf_attention.register(for_compiled_models=True)
    limit = _CACHE_SIZE_PER_LAYER * len(layers)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
    torch._dynamo.config.accumulated_cache_size_limit = max(
        torch._dynamo.config.accumulated_cache_size_limit, limit)
    start = time.perf_counter()
    handoff = residual_handoff.install(model, model.get_decoder(), layers)
    for layer in layers:
        compiled = torch.compile(layer.forward, dynamic=True)
        attention = _share_layer_index(layer)
        if attention is None:
            layer.forward = compiled
            continue
        handing_off = None if handoff is None else torch.compile(
            functools.partial(residual_handoff.handoff_forward, layer), dynamic=True)
        layer.forward = _compiled_for_ponytail_caches(layer, attention, compiled, handoff, handing_off)
    logger.info("compiling %d decoder layers with torch.compile (first steps compile; set up in %.1f s); residual "
                "adds handed to the next layer's norm: %s", len(layers), time.perf_counter() - start,
                "yes" if handoff is not None else "no (not LlamaDecoderLayer's forward)")
    return len(layers)


def restore_decoder_layers(model) -> None:
    """Undo compile_decoder_layers: every layer runs its class's own forward again."""
    from ..attention import hf_backend as hf_attention

    layers = decoder_layers(model)
    residual_handoff.uninstall(model, model.get_decoder())
    for layer in layers:
        layer.__dict__.pop("forward", None)
        attention = getattr(layer, "self_attn", None)
        if attention is not None and LAYER_INDEX_ATTR in vars(attention):
            attention.layer_idx = vars(attention).pop(LAYER_INDEX_ATTR)
    hf_attention.register()  # the plain function again


def _share_layer_index(layer):
    """The layer's attention keeps its index where only Ponytail's attention reads it; the traced
    `layer_idx` becomes 0, the same in every layer (see _CACHE_SIZE_PER_LAYER). Returns that
    attention module, or None where the layer has no such index (it compiles on its own)."""
    attention = getattr(layer, "self_attn", None)
    index = getattr(attention, "layer_idx", None)
    if attention is None or LAYER_INDEX_ATTR in vars(attention) or not isinstance(index, int):
        return None
    setattr(attention, LAYER_INDEX_ATTR, index)
    attention.layer_idx = 0
    return attention


def _compiled_for_ponytail_caches(layer, attention, compiled, handoff=None, handing_off=None):
    """The compiled forward with a Ponytail cache or none. A Ponytail cache stays out of the trace:
    the layer gets none (so its attention module does not call update()) and COMPILED_CALL, and
    its attention runs as the custom op, told the cache and the layer's real index here
    (attention/compiled_op.py): one graph for the whole layer. With a handoff (residual_handoff.py)
    that graph is `handing_off`, which leaves the layer's closing add to the next call. Any other
    cache (plain `generate`'s DynamicCache) files K/V under the traced layer_idx, which is 0 in every
    layer here: such a call runs the class's own forward, eagerly, with the layer's real index back
    for its duration."""
    eager = type(layer).forward
    layer_idx = vars(attention)[LAYER_INDEX_ATTR]

    def handing_off_call(hidden_states, *args, **kwargs):
        """The layer's output with the handoff (its closing add pending), or None: the stock graph runs."""
        if layer_idx == 0:
            residual = handoff.start(hidden_states, by_name_only=not args)
        elif handoff.active:
            residual = handoff.take(hidden_states, f"decoder layer {layer_idx}")
        if not handoff.active:
            return None
        return handoff.give(*handing_off(hidden_states, residual, **kwargs))

    def forward(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5.x renamed it
        if isinstance(cache, PagedCacheBase):
            if torch.is_grad_enabled():  # else the trace would want the op's backward, which it has none of
                raise ConfigError("a compiled layer with a Ponytail cache runs inference only: call the model "
                                  "under torch.inference_mode() or torch.no_grad(), as the engine does")
            kwargs.pop("cache", None)
            kwargs.pop("past_key_values", None)
            kwargs[compiled_op.COMPILED_CALL] = True
            with compiled_op.calling(cache, attention, layer_idx):
                out = None if handoff is None else handing_off_call(*args, **kwargs)
                return compiled(*args, **kwargs) if out is None else out
        if cache is None:
            return compiled(*args, **kwargs)
        attention.layer_idx = vars(attention)[LAYER_INDEX_ATTR]
        try:
            return eager(layer, *args, **kwargs)
        finally:
            attention.layer_idx = 0

    return forward
