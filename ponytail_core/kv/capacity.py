"""What one GPU holds for a model before anything is loaded: the KV pool LLM() would size there.

The same arithmetic as the engine's (budget.py) with the device's total memory given instead of
measured and the weights counted from the model's config instead of loaded. The CUDA context and
libraries' workspaces (a few hundred MiB, measured by the engine at start) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .budget import check_share, default_budget, share_budget, step_headroom
from .config import CacheConfig
from ..errors import ConfigError
from ..utils.units import format_bytes, format_bytes_binary


@dataclass(frozen=True, slots=True)
class DeviceCapacity:
    """The KV pool's ceiling on a device of device_memory bytes, and what it holds."""

    device_memory: int  # the device's total memory
    gpu_memory_utilization: float | None  # the share asked for; None: the engine's default sizing
    num_parameters: int  # the model's parameters (tied weights once)
    weight_bytes: int  # num_parameters in the cache's dtype
    step_headroom: int  # one step's activations, left free beside the pool by the default sizing (0 with a share)
    kv_budget: int  # the pool's ceiling in bytes
    kv_blocks: int  # whole blocks in kv_budget
    kv_tokens: int  # tokens those blocks hold
    max_concurrency: float  # full-length sequences (whole blocks) that fit at once

    def summary(self, max_seq_len: int) -> list[str]:
        """Lines for KVEstimate.summary: the device, what it holds besides the pool, the pool."""
        sizing = ("the engine's default: 90% of it less the weights, one step free"
                  if self.gpu_memory_utilization is None else f"gpu_memory_utilization={self.gpu_memory_utilization}")
        return [
            f"  device:              {_both(self.device_memory)} total ({sizing})",
            f"  weights:             {self.num_parameters:,} parameters, {_both(self.weight_bytes)}",
            f"  one step:            {_both(self.step_headroom)} left free",
            f"  KV pool ceiling:     {_both(self.kv_budget)}: {self.kv_tokens:,} tokens in {self.kv_blocks:,} blocks",
            f"  at once:             {self.max_concurrency:.2f} sequences of {max_seq_len:,} tokens; more of "
            "shorter ones (the pool grows as tokens need it)",
        ]


def _both(n: int) -> str:
    return f"{format_bytes(n)} ({format_bytes_binary(n)})"


def count_parameters(model_config: Any) -> int:
    """Parameters of the causal LM `model_config` describes, built on the meta device (nothing is
    allocated): what LLM() loads, tied embeddings counted once."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config)
    except (ValueError, ImportError, TypeError) as exc:  # no causal-LM class, or it needs remote code
        raise ConfigError(f"cannot count the model's parameters from its config "
                          f"({type(model_config).__name__}): {exc}") from None
    return sum(p.numel() for p in model.parameters())


def device_capacity(config: CacheConfig, text_config: Any, num_parameters: int, device_memory: int, *,
                    gpu_memory_utilization: float | None = None, max_num_seqs: int = 256,
                    max_num_batched_tokens: int = 8192) -> DeviceCapacity:
    """The KV pool LLM() would get on a device of device_memory bytes holding only this model's
    weights (config.dtype): the default sizing with its step headroom (max_num_seqs and
    max_num_batched_tokens: the engine's settings it depends on), or gpu_memory_utilization's."""
    element = config.dtype_size
    weights = num_parameters * element
    if gpu_memory_utilization is None:
        headroom = step_headroom(text_config, max_num_batched_tokens, max_num_seqs, element)
        budget = default_budget(device_memory, weights, headroom)
    else:
        check_share(gpu_memory_utilization)
        headroom = 0
        budget = share_budget(device_memory, gpu_memory_utilization, weights)
    if budget < config.block_bytes:
        raise ConfigError(f"device_memory={format_bytes(device_memory)} leaves no KV memory for this model: "
                          f"its weights take {format_bytes(weights)} and one step {format_bytes(headroom)}; "
                          "allowed: a larger device, a larger gpu_memory_utilization, or a smaller dtype")
    blocks = budget // config.block_bytes
    tokens = blocks * config.block_size
    return DeviceCapacity(device_memory=device_memory, gpu_memory_utilization=gpu_memory_utilization,
                          num_parameters=num_parameters, weight_bytes=weights, step_headroom=headroom,
                          kv_budget=budget, kv_blocks=blocks, kv_tokens=tokens,
                          max_concurrency=tokens / (config.blocks_per_seq * config.block_size))
