"""CacheConfig: the shape, dtype, budget and device of one paged KV cache, validated up front."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Any

import torch

from ..utils.dtypes import KV_CACHE_DTYPES, dtype_name, resolve_dtype, resolve_kv_cache_dtype
from ..utils.dtypes import dtype_size as _itemsize
from ..errors import ConfigError
from ..utils.units import parse_bytes
from ..utils.arith import cdiv

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block unless told: the one default every entry point uses

_DEVICES = '"cpu", "cuda", "cuda:N"'

# Fields from_model takes from the model and only lets an override repeat.
_SHAPE_FIELDS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "dtype")
# Fields from_model lets an override set freely (device must still match the model's).
_FREE_FIELDS = (
    "max_batch_size", "max_seq_len", "block_size", "memory_budget",
    "device", "chunk_blocks", "defrag_threshold", "kv_cache_dtype",
)


def check_positive_int(field: str, value: object) -> int:
    """Return value as an int if it is a positive integer (bool is not); else raise ConfigError."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ConfigError(
            f"{field}={value!r} ({type(value).__name__}) is not an int; allowed: a positive int"
        )
    if value <= 0:
        raise ConfigError(f"{field}={value!r} is not positive; allowed: a positive int")
    return int(value)


def resolve_device(value: object, field: str = "device") -> torch.device:
    """None -> "cuda" if available, else "cpu"; "cuda" -> cuda:<current>; the device must exist."""
    if value is None:
        value = "cuda" if torch.cuda.is_available() else "cpu"
    device = None
    if isinstance(value, torch.device):
        device = value
    elif isinstance(value, str):
        try:
            device = torch.device(value)
        except RuntimeError:  # "tpu", "cuda:x", "cuda:-1"
            pass
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{field}={value!r} is not a supported device; allowed: {_DEVICES}")
    if device.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"{field}={value!r} but CUDA is not available here "
            f'(torch.cuda.is_available() is False); allowed: "cpu"'
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise ConfigError(
            f"{field}={value!r} does not exist: this machine has {count} CUDA device(s); "
            f'allowed: "cpu", "cuda", "cuda:0" to "cuda:{count - 1}"'
        )
    return torch.device("cuda", index)


@dataclass(slots=True)
class CacheConfig:
    """Everything needed to size and place a paged KV cache; derived sizes are properties.

    Strings are accepted for dtype ("bf16"), memory_budget ("4GiB") and device ("cuda"); all
    three are normalized in __post_init__, so later code sees a torch.dtype, an int of bytes
    and a torch.device with an index for CUDA.
    """

    num_layers: int  # decoder layers; each has its own K and V blocks
    num_kv_heads: int  # key/value heads per layer (fewer than num_heads under GQA/MQA)
    head_dim: int  # elements per head
    dtype: torch.dtype  # the model's dtype: K and V as attention takes and returns them
    max_batch_size: int  # sequences served at once
    max_seq_len: int  # longest sequence, prompt plus generated tokens
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per block; a power of two
    num_heads: int | None = None  # query heads; None -> num_kv_heads
    memory_budget: int | str | None = None  # bytes for the pool; None -> max_batch_size full seqs
    device: str | torch.device | None = None  # None -> "cuda" if available else "cpu"
    chunk_blocks: int | None = None  # blocks the pool grows/shrinks by; None -> max_num_blocks / 8
    defrag_threshold: float = 0.1  # holes below the high-water mark / high-water mark to compact
    kv_cache_dtype: str = "auto"  # how the pool stores K/V: "auto" (dtype) or "fp8"/"fp8_e4m3" (scaled E4M3)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_batch_size", "max_seq_len",
                     "block_size"):
            setattr(self, name, check_positive_int(name, getattr(self, name)))
        self.dtype = resolve_dtype(self.dtype)
        self.kv_cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(
                f"block_size={self.block_size} is not a power of two; "
                "allowed: 1, 2, 4, 8, 16, 32, ..."
            )
        if self.num_heads is None:
            self.num_heads = self.num_kv_heads
        self.num_heads = check_positive_int("num_heads", self.num_heads)
        if self.num_heads % self.num_kv_heads:
            kv = self.num_kv_heads
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={kv}; "
                f"allowed: a positive multiple of {kv} ({kv}, {2 * kv}, {3 * kv}, ...)"
            )
        self.device = resolve_device(self.device)
        if self.is_fp8 and self.device.type == "cuda" and self.dtype == torch.float32:
            raise ConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r} with dtype=float32 on {self.device}: the "
                              "FP8 kernels dequantize into bfloat16 or float16; allowed: a bfloat16 or float16 "
                              "model with FP8, or kv_cache_dtype='auto'")
        if self.memory_budget is None:
            self.memory_budget = self.max_batch_size * self.blocks_per_seq * self.block_bytes
        else:
            budget = parse_bytes(self.memory_budget, "memory_budget")
            if budget < self.block_bytes:
                raise ConfigError(
                    f"memory_budget={self.memory_budget!r} ({budget:,} bytes) is smaller than "
                    f"one block of {self.block_bytes:,} bytes ({self.block_size} tokens x 2 "
                    f"(K and V) x {self.num_layers} layers x {self.num_kv_heads} KV heads x "
                    f"{self.head_dim} head_dim x {self.dtype_size} bytes); "
                    f"allowed: at least {self.block_bytes} bytes"
                )
            self.memory_budget = budget
        if self.chunk_blocks is not None:
            self.chunk_blocks = check_positive_int("chunk_blocks", self.chunk_blocks)
        threshold = self.defrag_threshold
        # NaN fails the range check too.
        if (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                or not 0 <= threshold <= 1):
            raise ConfigError(
                f"defrag_threshold={threshold!r} is outside [0, 1]; allowed: a number from 0 to 1"
            )
        self.defrag_threshold = float(threshold)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The element type the pool stores K and V in."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype

    @property
    def is_fp8(self) -> bool:
        """K/V are stored as scaled FP8 (kv/scales.py) and dequantized to dtype when read."""
        return self.kv_dtype != self.dtype

    @property
    def dtype_size(self) -> int:
        """Bytes per stored element of K or V."""
        return _itemsize(self.kv_dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes across all layers, K and V."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return self.bytes_per_token * self.block_size

    @property
    def blocks_per_seq(self) -> int:
        """Blocks a sequence of max_seq_len tokens needs."""
        return cdiv(self.max_seq_len, self.block_size)

    @property
    def max_num_blocks(self) -> int:
        """Blocks that fit in memory_budget."""
        return self.memory_budget // self.block_bytes

    @property
    def pool_chunk_blocks(self) -> int:
        """Blocks the pool grows/shrinks by: chunk_blocks or about an eighth of it, at most the pool."""
        chunk = self.chunk_blocks or growth_chunk_blocks(self.max_num_blocks, 8)
        return min(chunk, self.max_num_blocks)

    @property
    def layer_block_elems(self) -> int:
        """Elements of one block in one layer, for K or for V."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @classmethod
    def from_model(cls, model_or_config: Any, **overrides: Any) -> CacheConfig:
        """Build a CacheConfig for a transformers model (or its config).

        The shape (num_layers, num_heads, num_kv_heads, head_dim, dtype) and, for a model, the
        device come from the model; an override may repeat them but not contradict them.
        max_seq_len defaults to max_position_embeddings, max_batch_size to 1. An override of
        None means "use the default".
        """
        unknown = sorted(set(overrides) - set(_SHAPE_FIELDS) - set(_FREE_FIELDS))
        if unknown:
            raise ConfigError(
                f"unknown override {', '.join(f'{k}={overrides[k]!r}' for k in unknown)}; "
                f"allowed: {', '.join(_SHAPE_FIELDS + _FREE_FIELDS)}"
            )
        given = {k: v for k, v in overrides.items() if v is not None}
        config, name, dtype, device, dtype_source = _read_model(model_or_config)
        values: dict[str, Any] = {}
        for field, (value, label) in _model_shape(config, name).items():
            if field in given and check_positive_int(field, given[field]) != value:
                raise ConfigError(
                    f"{field}={given[field]!r} does not match the model ({name}): it has {label}"
                )
            values[field] = value
        if "dtype" in given:
            wanted = resolve_dtype(given["dtype"])
            if dtype is not None and wanted != dtype:
                shown = given["dtype"] if isinstance(given["dtype"], str) else dtype_name(wanted)
                raise ConfigError(
                    f"dtype={shown} does not match the model ({name}): "
                    f"{dtype_source} {dtype_name(dtype)}"
                )
            dtype = wanted
        values["dtype"] = dtype if dtype is not None else torch.float32
        if device is not None:
            if "device" in given and resolve_device(given["device"]) != device:
                raise ConfigError(
                    f"device={given['device']!r} does not match the model ({name}): its weights "
                    f"are on {device}, and the cache must live on the model's device"
                )
            values["device"] = device
        if "max_seq_len" not in given:
            values["max_seq_len"] = _attr(config, "max_position_embeddings", name,
                                          hint="; pass max_seq_len=... instead")
        values["max_batch_size"] = 1
        values.update((k, v) for k, v in given.items() if k in _FREE_FIELDS)
        return cls(**values)


def _read_model(obj: Any) -> tuple[Any, str, torch.dtype | None, torch.device | None, str]:
    """(text config, display name, dtype, device, where the dtype came from) of a model/config."""
    # Imported here: importing transformers takes seconds, and only from_model needs it.
    from transformers import PretrainedConfig, PreTrainedModel

    if isinstance(obj, PreTrainedModel):
        name = type(obj).__name__
        params = [p for p in obj.parameters() if p.is_floating_point()]
        if not params:
            raise ConfigError(f"the model ({name}) has no floating-point parameters to take "
                              "its dtype and device from")
        devices = sorted({str(p.device) for p in params})
        if len(devices) > 1:
            raise ConfigError(f"the model ({name}) has weights on several devices "
                              f"({', '.join(devices)}); a ponytail cache lives on one device")
        dtype = _supported(params[0].dtype, name, "weights of dtype")
        return _text_config(obj.config), name, dtype, params[0].device, "its weights are"
    if isinstance(obj, PretrainedConfig):
        name = (getattr(obj, "architectures", None) or [type(obj).__name__])[0]
        text = _text_config(obj)
        raw = getattr(obj, "dtype", None) or getattr(text, "dtype", None)
        dtype = None if raw in (None, "auto") else _supported(raw, name, "config dtype")
        return text, name, dtype, None, "its config has dtype"
    raise ConfigError(
        f"model_or_config={type(obj).__name__} object is not supported; "
        "allowed: a transformers PreTrainedModel or PretrainedConfig"
    )


def _text_config(config: Any) -> Any:
    """The language-model part of a (possibly multimodal) config."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _supported(raw: object, name: str, what: str) -> torch.dtype:
    try:
        return resolve_dtype(raw)
    except ConfigError:
        shown = dtype_name(raw) if isinstance(raw, torch.dtype) else raw
        raise ConfigError(f"the model ({name}) has {what} {shown}, which ponytail does not "
                          "support; allowed: bfloat16, float16, float32") from None


def _attr(config: Any, attr: str, name: str, hint: str = "") -> Any:
    value = getattr(config, attr, None)
    if value is None:
        raise ConfigError(f"the model ({name}) has no {attr} in its config; "
                          f"CacheConfig.from_model needs it{hint}")
    return value


def _model_shape(config: Any, name: str) -> dict[str, tuple[int, str]]:
    """Shape fields -> (model's value, how the model names it) for mismatch messages."""
    layers = _attr(config, "num_hidden_layers", name)
    heads = _attr(config, "num_attention_heads", name)
    kv_heads = getattr(config, "num_key_value_heads", None)
    kv_label = f"num_key_value_heads={kv_heads}"
    if kv_heads is None:  # no GQA field: one KV head per query head
        kv_heads, kv_label = heads, f"num_attention_heads={heads} and no num_key_value_heads"
    head_dim = getattr(config, "head_dim", None)
    hd_label = f"head_dim={head_dim}"
    if head_dim is None:
        hidden = _attr(config, "hidden_size", name, hint=" (or head_dim)")
        if hidden % heads:
            raise ConfigError(f"the model ({name}) has no head_dim and hidden_size={hidden} is not "
                              f"a multiple of num_attention_heads={heads}")
        head_dim = hidden // heads
        hd_label = f"head_dim={head_dim} (hidden_size={hidden} // num_attention_heads={heads})"
    return {
        "num_layers": (layers, f"num_hidden_layers={layers}"),
        "num_heads": (heads, f"num_attention_heads={heads}"),
        "num_kv_heads": (kv_heads, kv_label),
        "head_dim": (head_dim, hd_label),
    }


def growth_chunk_blocks(max_num_blocks: int, steps: int) -> int:
    """Blocks a chunk for a pool that grows to max_num_blocks in about `steps` chunks. Rounded down,
    the chunks that fit leave fewer than `steps` blocks of the budget unused; rounded up they could
    leave almost a whole chunk (1/steps of the budget: 1.6% of an 80 GB card's pool at 64)."""
    return max(1, max_num_blocks // steps)
