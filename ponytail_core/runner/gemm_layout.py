"""The decoder's projection weights stored column-major and multiplied through cuBLASLt.

F.linear(x, W) computes x @ W.T. Stored as transformers loads it (W [out, in], row-major), W.T is a
transposed operand; stored column-major (the same logical tensor, strides (1, out)), W.T is a
plain row-major [in, out] matrix and cuBLAS runs other kernels, faster for a 7B's shapes at the
row counts of decode and prefill steps (docs/benchmarks.md). Parameters keep their shapes and
names (state_dict tensors are strided views), no memory is added once the copy is done, and fused
q/k/v and gate/up weights keep the layout (fused_projections concatenates along it). Outputs are the same GEMMs
summed in another order: equal to rounding, not bitwise.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from .compile import can_compile, decoder_layers

logger = logging.getLogger("ponytail.engine")

_WRAPPED_ATTR = "_ponytail_cublaslt"
# Set by fused_projections on the members of a fused group: their layout is the group's, and the
# passes here leave them to it.
FUSED_ATTR = "_ponytail_fused"


def is_column_major(weight: torch.Tensor) -> bool:
    """A 2-D weight [out, in] laid out by columns (a fused member's rows of one too), so that F.linear
    multiplies by its transpose as a plain row-major matrix."""
    return weight.dim() == 2 and weight.shape[0] > 1 and weight.stride(0) == 1 and weight.stride(1) >= weight.shape[0]


def _set_weight(linear: torch.nn.Linear, weight: torch.Tensor) -> None:
    with torch.no_grad():
        linear.weight = torch.nn.Parameter(weight, requires_grad=linear.weight.requires_grad)


def _projections(model, wanted_by: str) -> list[torch.nn.Linear]:
    """Every plain nn.Linear in the decoder layers, then the LM head where it is one and not the
    input embedding's weight (a tied head stays: embedding lookups want rows)."""
    linears = [m for layer in decoder_layers(model, wanted_by=wanted_by)
               for m in layer.modules() if type(m) is torch.nn.Linear]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if type(head) is torch.nn.Linear and (embedding is None or head.weight.data_ptr() != embedding.weight.data_ptr()):
        linears.append(head)
    return linears


def column_major_weights(model) -> int:
    """Stores the weights of _projections(model) column-major; returns how many changed. Run it
    before fuse_projections (which keeps its members' layout; members fused already are left to
    their group) and before compiling or capturing graphs (both record the strides)."""
    linears = [m for m in _projections(model, "column_major_weights=True") if FUSED_ATTR not in vars(m)]
    relaid = [m for m in linears if not is_column_major(m.weight) and min(m.weight.shape) > 1]  # a vector: same memory
    for m in relaid:
        _set_weight(m, m.weight.detach().t().contiguous().t())
    logger.info("stored %d of %d projection weights column-major", len(relaid), len(linears))
    return len(relaid)


@contextlib.contextmanager
def blas_library(name: str | None):
    """torch's preferred BLAS library for the GEMMs (and graph captures) inside; restored after.
    None, or no CUDA: nothing changes."""
    if name is None or not torch.cuda.is_available():
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def forward_through_cublaslt(model) -> None:
    """Every call of model(...) runs its GEMMs through cuBLASLt: the preference is torch's global
    setting, so it is set for the call and restored after, and the rest of the process keeps its own."""
    if _WRAPPED_ATTR in vars(model):
        return
    forward = model.forward

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        with blas_library("cublaslt"):
            return forward(*args, **kwargs)

    model.forward = wrapped
    setattr(model, _WRAPPED_ATTR, True)


def row_major_weights(model) -> int:
    """Undo column_major_weights and forward_through_cublaslt: weights laid out as transformers
    loads them, calls through torch's default library (a benchmark hands the model to the next
    engine). Run it after unfuse_projections; returns how many weights changed."""
    if vars(model).pop(_WRAPPED_ATTR, None):
        vars(model).pop("forward", None)
    if not can_compile(model):
        return 0
    relaid = [m for m in _projections(model, "row_major_weights") if is_column_major(m.weight)]
    for m in relaid:
        _set_weight(m, m.weight.detach().contiguous())
    return len(relaid)
