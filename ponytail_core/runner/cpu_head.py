"""The output projection on the CPU through oneDNN, its weight reordered once.

A decode step multiplies a few rows (one per sampled sequence) by the vocabulary projection: for
SmolLM2-135M 49,152 x 576 floats, a fifth of the model's weights. torch's CPU linear (MKL sgemm)
re-packs that weight on every call at such row counts; oneDNN with the weight reordered ahead of
time reads it once. Measured on 2 cores, 8 rows: 20 ms -> 7.6 ms a step, which took the default
model's `bench_engine.py --small` from parity to 1.06x plain generate (docs/benchmarks.md). The math is the same float32
product summed in another order: logits within float32 rounding of F.linear's.

The engine's runner switches the head's forward to this one only while it runs a step, so the
model object a user handed over still runs its own head in `model.generate` (bench_engine's plain
peer shares it). A weight changed in place or replaced is packed again before its next use.
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger("ponytail.engine")

# Above this many rows oneDNN's reordered weight measured slower than torch's linear (256 rows:
# 118 vs 105 ms for SmolLM2's head); a CPU step samples at most max_num_seqs rows, 64 in Serve.
MAX_ROWS = 128


def _weight_version(weight: torch.Tensor) -> int | None:
    try:
        return weight._version
    except RuntimeError:  # an inference tensor keeps no version: it cannot be changed in place either
        return None


class PrepackedHead:
    """Runs `linear` (float32, on the CPU) through torch.ops.mkldnn with a reordered weight."""

    def __init__(self, linear: torch.nn.Linear):
        self.linear = linear
        self._pack()

    def _pack(self) -> None:
        weight = self.linear.weight
        self._source = (weight, _weight_version(weight))
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def _stale(self) -> bool:
        weight, version = self._source
        return self.linear.weight is not weight or _weight_version(weight) != version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > MAX_ROWS or torch.is_grad_enabled():
            return torch.nn.functional.linear(x, self.linear.weight, self.linear.bias)
        if self._stale():
            self._pack()
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), self._packed, self.linear.bias,
                                               "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])

    @contextlib.contextmanager
    def active(self):
        """The head runs through forward() inside this block only."""
        self.linear.forward = self.forward
        try:
            yield
        finally:
            del self.linear.forward


def prepacked_head(model) -> PrepackedHead | None:
    """A PrepackedHead for the model's output projection where it applies: a float32 nn.Linear on
    the CPU, with torch built with oneDNN; None otherwise (the head runs as it is)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or head.weight.device.type != "cpu" or head.weight.dtype != torch.float32:
        return None
    if head.bias is not None and head.bias.dtype != torch.float32:
        return None
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        logger.info("torch has no oneDNN linear here: the output projection runs through torch's linear")
        return None
    return PrepackedHead(head)
