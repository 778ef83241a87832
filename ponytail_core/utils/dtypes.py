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


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a dtype: torch.float16 -> "float16"."""
    return str(dtype).removeprefix("torch.")


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element: torch.float16 -> 2."""
    return dtype.itemsize
