"""`ponytail.create_cache`: the entry point users already know from other KV-cache plug-ins."""

from __future__ import annotations

from typing import Any

from ..attention import hf_backend as hf_attention
from ..errors import ConfigError
from ..kv.config import CacheConfig
from ..models.kv_scales import set_kv_scales
from .cache import PonytailCache


def create_cache(model: Any = None, *, max_batch_size: int, max_seq_len: int | None = None,
                 num_layers: int | None = None, num_heads: int | None = None,
                 num_kv_heads: int | None = None, head_dim: int | None = None,
                 dtype: Any = None, calculate_kv_scales: bool = False, **options: Any) -> PonytailCache:
    """A paged KV cache to hand to `model.generate(..., cache=cache)`.

    With a model (a transformers model or config) every shape field comes from it, and any
    value given here that disagrees raises `ConfigError` naming the field, the value given and
    the model's; a model also gets attn_implementation "ponytail" so its attention reads the
    blocks in place (calls without a Ponytail cache still run the model's previous
    attention implementation). Without one, `num_heads` is the number of KV heads unless `num_kv_heads` is
    also given (then `num_heads` counts query heads). `options` are the remaining CacheConfig
    fields: block_size, memory_budget, device, chunk_blocks, defrag_threshold, kv_cache_dtype.

    kv_cache_dtype="fp8" stores K/V as FP8 with a scale per layer for K and for V: the model's
    checkpoint scales (k_scale / v_scale) where it has them, else with calculate_kv_scales=True
    the first prompt's, else 1.0 with a warning (docs/fp8.md).
    """
    if not isinstance(calculate_kv_scales, bool):
        raise ConfigError(f"calculate_kv_scales={calculate_kv_scales!r} is not supported; allowed: True or False")
    shape = {"num_layers": num_layers, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
             "head_dim": head_dim, "dtype": dtype, "max_seq_len": max_seq_len}
    given = {k: v for k, v in shape.items() if v is not None}
    if model is not None:
        config = CacheConfig.from_model(model, max_batch_size=max_batch_size, **given, **options)
        if hasattr(model, "set_attn_implementation"):
            hf_attention.switch_model(model)  # forwards without this cache keep the old attention
    else:
        if num_kv_heads is None and num_heads is not None:
            given["num_kv_heads"] = given.pop("num_heads")
        config = CacheConfig(max_batch_size=max_batch_size, **given, **options)
    cache = PonytailCache(config)
    if cache.paged.storage.scales is not None:
        set_kv_scales(cache.paged.storage.scales, model, calculate=calculate_kv_scales)
    return cache
