"""The KV pool's memory budget: what LLM's kv_cache_memory and gpu_memory_utilization mean.

On CUDA the default is what vLLM's default gpu_memory_utilization=0.9 reserves on a device it owns:
90% of the device less this process's tensors (the weights), so the other 10% holds the CUDA
context and a step's activations; never more than is free less one step's activations. A ceiling
the pool grows to as tokens need it, never a reservation. On the CPU there is no device to
measure: 2 GiB unless told.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..utils.units import format_bytes, parse_bytes

CPU_DEFAULT_KV_MEMORY = 2 << 30
DEFAULT_GPU_SHARE = 0.9  # vLLM's default gpu_memory_utilization: the KV pool's ceiling (_default_device_share)


def kv_budget(kv_cache_memory, device: torch.device, gpu_memory_utilization: float | None = None,
              headroom: int = 0) -> int:
    """Bytes the KV pool may grow to: kv_cache_memory (bytes or "4GiB"), or gpu_memory_utilization
    (a share of the device), or the default; headroom: one step's transient memory (step_headroom)."""
    if gpu_memory_utilization is not None:
        if kv_cache_memory is not None:
            raise ConfigError(f"kv_cache_memory={kv_cache_memory!r} and gpu_memory_utilization="
                              f"{gpu_memory_utilization!r} were both given; allowed: one of them")
        return _share_of_device(gpu_memory_utilization, device)
    if kv_cache_memory is not None:
        return parse_bytes(kv_cache_memory, "kv_cache_memory")
    if device.type == "cuda":
        return _default_device_share(device, headroom)
    return CPU_DEFAULT_KV_MEMORY


STEP_HEADROOM_FIXED = 64 << 20  # cuBLAS workspaces, CUDA graph pools, sampling buffers


def step_headroom(text_config, max_num_batched_tokens: int, max_num_seqs: int, dtype_size: int) -> int:
    """A generous estimate of one step's transient memory (the KV pool never grows into it): a
    layer's activations for the full token budget (hidden states, attention, MLP) and fp32
    logits for every sequence, plus a fixed part."""
    hidden = int(getattr(text_config, "hidden_size", 4096))
    intermediate = int(getattr(text_config, "intermediate_size", 4 * hidden))
    vocab = int(getattr(text_config, "vocab_size", 32000))
    activations = max_num_batched_tokens * (6 * hidden + 3 * intermediate) * dtype_size
    return STEP_HEADROOM_FIXED + activations + max_num_seqs * vocab * 4


def check_share(share: float) -> None:
    """A ConfigError unless gpu_memory_utilization=share is a share of the device in (0, 1]."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ConfigError(f"gpu_memory_utilization={share!r} is not supported; allowed: a share of the "
                          "device's total memory in (0, 1], e.g. 0.9 (or None: kv_cache_memory decides)")


def share_budget(total: int, share: float, held: int) -> int:
    """gpu_memory_utilization=share's KV budget on a device of `total` bytes where this process holds
    `held` (the weights and torch's cache): the share of the device less that."""
    return int(total * share) - held


def default_budget(total: int, held: int, headroom: int, available: int | None = None) -> int:
    """The default KV ceiling on a device of `total` bytes where this process's tensors take `held`
    (the weights): DEFAULT_GPU_SHARE of the device less those, and no more than is `available`
    (default: all the device less `held`) less one step's activations (`headroom`). vLLM's
    reservation works out the same on a device it owns (docs/benchmarks.md compares them): the 10%
    left out holds the CUDA context, libraries' workspaces and the steps' activations, rather than
    the 90% paying for them a second time."""
    available = total - held if available is None else available
    return min(int(total * DEFAULT_GPU_SHARE) - held, available - headroom)


def _share_of_device(share: float, device: torch.device) -> int:
    """KV budget for gpu_memory_utilization (as vLLM's): this process may hold `share` of the
    device's total memory; the KV pool gets that less what the process holds already (weights,
    CUDA graphs' pools, torch's cache). Independent of what others hold now, so two replicas at
    0.45 each fit one GPU whatever order they start in."""
    check_share(share)
    if device.type != "cuda":
        raise ConfigError(f"gpu_memory_utilization={share!r} needs a CUDA device; the model is on {device}: "
                          "use kv_cache_memory")
    _, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    budget = share_budget(total, share, held)
    if budget <= 0:
        raise ConfigError(f"gpu_memory_utilization={share!r} allows {format_bytes(int(total * share))} of "
                          f"{format_bytes(total)}, but this process already holds {format_bytes(held)} "
                          "(the model): allowed: a larger share")
    return budget


def _default_device_share(device: torch.device, headroom: int) -> int:
    """The KV pool's default ceiling on CUDA (default_budget): 90% of the device's total less this
    process's tensors, and never more than is available now less one step's activations (headroom).
    torch's cached but unused memory counts as available (an earlier engine's pool, freed); what
    other processes hold does not. A ceiling, not a reservation: the pool grows to it as tokens
    need it, and each growth leaves a step's activations free (PagedKVCache's device headroom)."""
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_allocated(device)
    available = free + torch.cuda.memory_reserved(device) - held
    budget = default_budget(total, held, headroom, available)
    if budget <= 0:
        raise ConfigError(f"kv_cache_memory=None leaves no KV memory on {device}: {format_bytes(total - available)} "
                          f"of {format_bytes(total)} in use (this process's weights and any other tenant's), 90% "
                          f"the ceiling, and a step needs {format_bytes(headroom)}; allowed: an explicit "
                          "kv_cache_memory, or a smaller model")
    return budget
