"""The per-layer scales of an FP8 KV pool, and the one rounding every path quantizes with.

A layer's K (and its V) is stored as `fp8(clamp(x / scale, -448, 448))` and read as
`float(stored) * scale`: one fp32 scale per layer for K and one for V (per-tensor, as the
checkpoints of llm-compressor and vLLM carry them). The scales live on the pool's device as a
[num_layers, 2] fp32 tensor, so kernels read them without a host round trip and a calculation
(`calculate_on_first_write`) changes them in place.

Where the scales come from, in order (models/kv_scales.py's `set_kv_scales`):
  * the checkpoint's `k_scale` / `v_scale` (or `k_proj.output_scale` / `v_proj.output_scale`);
  * calculated from the first K/V the pool is given, as vLLM's calculate_kv_scales does:
    amax(|K|) / 200 and amax(|V|) / 100, headroom for later tokens larger than the first batch's;
  * else 1.0, with a warning: then values below 2^-6 lose precision in E4M3's subnormals.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..utils.dtypes import FP8_MAX

# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT: the first batch's largest |K| lands at 200, |V| at 100.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) / scale, saturated to the finite FP8 range and rounded to nearest even.
    The kernels (cache_ops.cu, paged_attention.cu) compute exactly this, bit for bit."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored FP8 back to dtype: float(stored) * scale, in fp32 before the final rounding."""
    return (stored.float() * scale).to(dtype)


def indexable(t: torch.Tensor) -> torch.Tensor:
    """t, or for FP8 the same memory as uint8: torch has no index_copy_ / index_fill_ for FP8 on the
    CPU, and moving FP8 values is moving bytes."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class KVScales:
    """The scales of one pool: `values[layer, 0]` for K, `values[layer, 1]` for V."""

    def __init__(self, num_layers: int, device: torch.device):
        self.num_layers = num_layers
        self.values = torch.ones((num_layers, 2), dtype=torch.float32, device=device)
        self.source = "default"  # then "checkpoint" (set) or "calculated" (calculate_on_first_write)
        self._pending: set[int] = set()  # layers whose scales the next write calculates

    def set(self, k_scales: object, v_scales: object) -> None:
        """Take one scale per layer for K and for V (a checkpoint's): a number, or a tensor of shape
        (), (1,) or (num_layers,); every scale must be finite and positive."""
        columns = [self._per_layer(name, value) for name, value in (("k_scale", k_scales), ("v_scale", v_scales))]
        self.values.copy_(torch.stack(columns, dim=1).to(self.values.device))
        self.source = "checkpoint"
        self._pending.clear()

    def calculate_on_first_write(self) -> None:
        """Let the next write to each layer set that layer's scales from its K/V (vLLM's rule)."""
        self._pending = set(range(self.num_layers))
        self.source = "calculated"

    @property
    def calculating(self) -> bool:
        return bool(self._pending)

    def observe(self, layer_start: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """keys/values [layers, tokens, heads, dim] about to be written from layer_start to `slots`
        (-1: not written): layers still waiting for their scales take them from the written tokens'
        values. Selecting the written tokens waits for the device once a call, on the first prompt only."""
        written = slots >= 0
        keys, values = keys[:, written], values[:, written]
        for i in range(keys.shape[0]):
            layer = layer_start + i
            if layer not in self._pending or keys.shape[1] == 0:
                continue
            tiny = torch.finfo(torch.float32).tiny
            self.values[layer, 0] = (keys[i].abs().amax().float() / K_SCALE_CONSTANT).clamp_min(tiny)
            self.values[layer, 1] = (values[i].abs().amax().float() / V_SCALE_CONSTANT).clamp_min(tiny)
            self._pending.discard(layer)

    def _per_layer(self, name: str, value: object) -> torch.Tensor:
        tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)
        if tensor.dim() == 0 or tuple(tensor.shape) == (1,):
            tensor = tensor.reshape(1).expand(self.num_layers)
        if tuple(tensor.shape) != (self.num_layers,):
            raise ConfigError(f"{name} has shape {tuple(tensor.shape)}; allowed: a number, or a tensor of shape (), "
                              f"(1,) or ({self.num_layers},) (one scale per layer; per-head scales are not supported)")
        tensor = tensor.detach().to("cpu", torch.float32)
        if not bool(torch.isfinite(tensor).all()) or bool((tensor <= 0).any()):
            raise ConfigError(f"{name}={tensor.tolist()} has a scale that is not finite and positive; "
                              "allowed: finite scales > 0")
        return tensor
