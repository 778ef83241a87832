"""The KV-cache dtypes Ponytail supports, and the names users may spell them by."""

from __future__ import annotations

import torch

from ..errors import ConfigError

# Canonical name -> dtype. Only these three: the kernels are templated over exactly these.
_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}

# Alias -> canonical name.
_ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}

_ALLOWED = f"{', '.join(_DTYPES)} (aliases: {', '.join(_ALIASES)})"


def resolve_dtype(value: object, field: str = "dtype") -> torch.dtype:
    """Turn a torch.dtype or a name ("fp16", "torch.bfloat16", ...) into a supported torch.dtype."""
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
    elif isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        name = _ALIASES.get(name, name)
        if name in _DTYPES:
            return _DTYPES[name]
    raise ConfigError(f"{field}={value!r} is not supported; allowed: {_ALLOWED}")


# kv_cache_dtype values: "auto" stores K/V in the model's dtype; the FP8 names store OCP E4M3 bytes
# (torch.float8_e4m3fn: finite, saturating at +-448) with a per-layer scale for K and for V. E5M2
# keeps two fewer mantissa bits for a range the scaled values never use, so it is not offered.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def resolve_kv_cache_dtype(value: object, field: str = "kv_cache_dtype") -> str:
    """Check a kv_cache_dtype name ("auto", "fp8", "fp8_e4m3"); returns it lowercased."""
    name = value.strip().lower() if isinstance(value, str) else None
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"{field}={value!r} is not supported; allowed: {', '.join(KV_CACHE_DTYPES)} "
                          "(auto: the model's dtype)")
    return name


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a dtype: torch.float16 -> "float16"."""
    return str(dtype).removeprefix("torch.")


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element: torch.float16 -> 2."""
    return dtype.itemsize
