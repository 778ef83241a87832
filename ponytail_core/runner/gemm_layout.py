"""The decoder's projection weights stored column-major and multiplied through cuBLASLt.

F.linear(x, W) computes x @ W.T. Stored as transformers loads it (W [out, in], row-major), W.T is a
transposed operand; stored column-major (the same logical tensor, strides (1, out)), W.T is a
plain row-major [in, out] matrix and cuBLAS runs other kernels. On an H200 with a 7B's shapes
(benchmarks/probe_gemm.py, docs/benchmarks.md, eighteenth session) that layout with cuBLASLt ran a
forward pass's GEMMs 7% faster at 64 rows (fixed's decode steps), 5% at 128 and 2.7% at 8,192
(prefill steps); 2% slower at 256 rows. Parameters keep their shapes and names (state_dict
tensors are strided views), no memory is added once the copy is done, and fused q/k/v and gate/up
weights keep the layout (fused_projections concatenates along it). Outputs are the same GEMMs
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


def is_column_major(weight: torch.Tensor) -> bool:
    """A 2-D weight [out, in] laid out by columns (a fused member's rows of one too), so that F.linear
    multiplies by its transpose as a plain row-major matrix."""
    return weight.dim() == 2 and weight.shape[0] > 1 and weight.stride(0) == 1 and weight.stride(1) >= weight.shape[0]


def _relayout(linear: torch.nn.Linear) -> bool:
    weight = linear.weight
    if is_column_major(weight) or weight.shape[0] == 1 or weight.shape[1] == 1:
        return False  # done already, or a vector (both layouts are the same memory)
    with torch.no_grad():
        linear.weight = torch.nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=weight.requires_grad)
    return True


def column_major_weights(model) -> int:
    """Stores every plain nn.Linear weight in the decoder layers, and the LM head's where it is not
    the input embedding's (a tied head stays: embedding lookups want rows), column-major; returns
    how many changed. Run it before fuse_projections (which keeps its members' layout) and before
    compiling or capturing graphs (both record the strides)."""
    linears = [m for layer in decoder_layers(model, wanted_by="column_major_weights=True")
               for m in layer.modules() if type(m) is torch.nn.Linear and "_ponytail_fused" not in vars(m)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if type(head) is torch.nn.Linear and (embedding is None or head.weight.data_ptr() != embedding.weight.data_ptr()):
        linears.append(head)
    changed = sum(_relayout(m) for m in linears)
    logger.info("stored %d of %d projection weights column-major", changed, len(linears))
    return changed


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
    linears = [m for layer in decoder_layers(model) for m in layer.modules() if type(m) is torch.nn.Linear]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears += [head] if type(head) is torch.nn.Linear else []
    changed = 0
    for m in linears:
        if is_column_major(m.weight):
            with torch.no_grad():
                m.weight = torch.nn.Parameter(m.weight.detach().contiguous(), requires_grad=m.weight.requires_grad)
            changed += 1
    return changed
