"""How much memory a KV cache needs, before allocating any of it."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .capacity import DeviceCapacity
from .config import DEFAULT_BLOCK_SIZE, CacheConfig
from ..errors import ConfigError
from ..utils.dtypes import dtype_name
from ..utils.units import format_bytes, format_bytes_binary, parse_bytes


@dataclass(frozen=True, slots=True)
class KVEstimate:
    """The memory a KV cache of one shape takes: exact, and with sequences rounded to blocks."""

    num_layers: int  # decoder layers
    num_kv_heads: int  # key/value heads per layer
    head_dim: int  # elements per head
    dtype: str  # canonical dtype name, e.g. "float16"
    block_size: int  # tokens per block
    max_batch_size: int  # sequences held at once
    max_seq_len: int  # tokens per sequence
    bytes_per_token: int  # one token across all layers, K and V
    tokens_per_seq_rounded: int  # max_seq_len rounded up to whole blocks
    total_bytes: int  # max_batch_size sequences of exactly max_seq_len tokens
    total_bytes_blocks: int  # the same with each sequence rounded up to whole blocks
    gpu_memory: int | None  # KV memory available, if asked
    max_concurrent_seqs: int | None  # full-length sequences that fit in gpu_memory, if asked
    device: DeviceCapacity | None = None  # with a device's total memory: how gpu_memory was sized
    kv_cache_dtype: str = "auto"  # how the pool stores K/V ("auto": dtype)
    # The same cache stored the other way (FP8 for "auto", the model's dtype for FP8), to compare.
    other_kv_cache_dtype: str = "fp8"
    other_bytes_per_token: int = 0
    other_max_concurrent_seqs: int | None = None

    @property
    def bytes_per_seq_blocks(self) -> int:
        """One full-length sequence, rounded up to whole blocks."""
        return self.tokens_per_seq_rounded * self.bytes_per_token

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict, ready for json.dumps."""
        return asdict(self)

    def summary(self) -> str:
        """A few lines for people: shape, per-token cost, totals and what fits in gpu_memory."""
        elsize = self.bytes_per_token // (2 * self.num_layers * self.num_kv_heads * self.head_dim)
        stored = self.dtype if self.kv_cache_dtype == "auto" else f"FP8 (kv_cache_dtype={self.kv_cache_dtype}) for a {self.dtype} model"
        lines = [
            f"KV cache: {self.num_layers} layers x {self.num_kv_heads} KV heads x head_dim "
            f"{self.head_dim}, {stored} ({elsize} bytes), K and V",
            f"  per token:           {describe_bytes(self.bytes_per_token)}",
            f"  sequences:           {self.max_batch_size:,} x {self.max_seq_len:,} tokens "
            f"({self.tokens_per_seq_rounded:,} in blocks of {self.block_size})",
            f"  per sequence:        {describe_bytes(self.bytes_per_seq_blocks)}, whole blocks",
            f"  total:               {describe_bytes(self.total_bytes)}",
            f"  total, whole blocks: {describe_bytes(self.total_bytes_blocks)}",
        ]
        if self.device is not None:
            lines.extend(self.device.summary(self.max_seq_len))
        elif self.gpu_memory is not None:
            lines.append(
                f"  gpu memory:          {describe_bytes(self.gpu_memory)} holds "
                f"{self.max_concurrent_seqs:,} sequences of {self.max_seq_len:,} tokens"
            )
        ratio = self.bytes_per_token / self.other_bytes_per_token
        fits = ("" if self.other_max_concurrent_seqs is None else
                f", {self.other_max_concurrent_seqs:,} sequences in the same memory")
        lines.append(f"  kv_cache_dtype={self.other_kv_cache_dtype}: {describe_bytes(self.other_bytes_per_token)} per token, "
                     f"{ratio:.2f}x the tokens{fits}")
        return "\n".join(lines)


def describe_bytes(n: int) -> str:
    """8589934592 -> "8,589,934,592 bytes (8.6 GB, 8.0 GiB)"."""
    return f"{n:,} bytes ({format_bytes(n)}, {format_bytes_binary(n)})"


def estimate_kv_cache(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str | torch.dtype,
    max_batch_size: int,
    max_seq_len: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    gpu_memory: int | str | None = None,
    kv_cache_dtype: str = "auto",
) -> KVEstimate:
    """Estimate the KV memory of a model shape; gpu_memory ("80GB") also answers how many fit."""
    # CacheConfig does the validation; "cpu" keeps the estimate independent of this machine.
    config = CacheConfig(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        block_size=block_size,
        device="cpu",
        kv_cache_dtype=kv_cache_dtype,
    )
    return estimate_from_config(config, gpu_memory=gpu_memory)


def estimate_from_config(config: CacheConfig, gpu_memory: int | str | None = None,
                         device: DeviceCapacity | None = None) -> KVEstimate:
    """Estimate the KV memory of config's max_batch_size sequences of max_seq_len tokens; gpu_memory:
    the KV memory available, or device: a device's capacity (capacity.py), whose pool it is."""
    if gpu_memory is not None and device is not None:
        raise ConfigError(f"gpu_memory={gpu_memory!r} and a device's capacity were both given; allowed: one")
    if device is not None:
        gpu = device.kv_budget
    else:
        gpu = None if gpu_memory is None else parse_bytes(gpu_memory, "gpu_memory")
    tokens_rounded = config.blocks_per_seq * config.block_size
    seq_bytes = tokens_rounded * config.bytes_per_token
    other = dataclasses.replace(config, kv_cache_dtype="fp8" if config.kv_cache_dtype == "auto" else "auto",
                                memory_budget=None, device="cpu")
    return KVEstimate(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=dtype_name(config.dtype),
        block_size=config.block_size,
        max_batch_size=config.max_batch_size,
        max_seq_len=config.max_seq_len,
        bytes_per_token=config.bytes_per_token,
        tokens_per_seq_rounded=tokens_rounded,
        total_bytes=config.bytes_per_token * config.max_seq_len * config.max_batch_size,
        total_bytes_blocks=seq_bytes * config.max_batch_size,
        gpu_memory=gpu,
        max_concurrent_seqs=None if gpu is None else gpu // seq_bytes,
        device=device,
        kv_cache_dtype=config.kv_cache_dtype,
        other_kv_cache_dtype=other.kv_cache_dtype,
        other_bytes_per_token=other.bytes_per_token,
        other_max_concurrent_seqs=None if gpu is None else gpu // (tokens_rounded * other.bytes_per_token),
    )
