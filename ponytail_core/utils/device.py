"""Moving host data to the device the way every step does it."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. Headed to CUDA it is pinned and copied without blocking, queued
    on the current stream, so the host goes on building the step instead of waiting for the copy."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
