"""One GEMM for projections that read the same input: q/k/v, and gate/up in the MLP.

A stock transformers layer calls q_proj, k_proj and v_proj on the same hidden states, one GEMM each
(inductor does not merge them). Here their weights become row slices of one concatenated weight
(no extra memory, the modules and their state_dict names stay), and each member's forward is
replaced: the first member's call runs the one GEMM and keeps the other outputs; a later member
called with that same tensor takes its slice. A member called with anything else (another order,
another input) runs its own GEMM, so the result is the same as without fusing whatever the
calling code does. The layer's own forward is not touched.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .compile import can_compile, decoder_layers
from .gemm_layout import FUSED_ATTR, is_column_major

logger = logging.getLogger("ponytail.engine")

# (attribute on the layer, member projections in the order the stock forwards call them)
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


class _Pending:
    """The last fused GEMM's input and its outputs, until every member took its own."""

    __slots__ = ("input", "outputs")

    def __init__(self):
        self.input = None
        self.outputs = None


def _member_forward(linear: torch.nn.Linear, index: int, last: int, weight: torch.Tensor,
                    bias: torch.Tensor | None, sizes: list[int], pending: _Pending):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if index == 0:
            outputs = F.linear(x, weight, bias).split(sizes, dim=-1)
            pending.input, pending.outputs = x, outputs
            return outputs[0]
        if pending.outputs is None or pending.input is not x:
            return F.linear(x, linear.weight, linear.bias)  # not the fused call's input: its own GEMM
        out = pending.outputs[index]
        if index == last:
            pending.input = pending.outputs = None
        return out

    return forward


def _fusable(linears: list) -> bool:
    first = linears[0]
    return (all(type(m) is torch.nn.Linear for m in linears)
            and all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
                    and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None)
                    for m in linears))


def _group(layer, attr: str, names: tuple[str, ...]) -> list | None:
    """The group's member modules, or None where the layer lacks one of them."""
    owner = getattr(layer, attr, None)
    linears = [getattr(owner, name, None) for name in names] if owner is not None else [None]
    return None if any(m is None for m in linears) else linears


def _fuse_group(linears: list) -> bool:
    """Fuses one group in place; True where it is fused now (already fused counts: fusing twice is a no-op)."""
    if FUSED_ATTR in vars(linears[0]):
        return True
    if not _fusable(linears):
        return False
    with torch.no_grad():
        if all(is_column_major(m.weight) for m in linears):  # gemm_layout ran first: keep its layout
            weight = torch.cat([m.weight.t() for m in linears], dim=1).t()
        else:
            weight = torch.cat([m.weight for m in linears])
        bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
    sizes = [m.out_features for m in linears]
    start = 0
    for m, size in zip(linears, sizes):  # the members' parameters become views of the fused ones
        m.weight = torch.nn.Parameter(weight[start:start + size], requires_grad=False)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias[start:start + size], requires_grad=False)
        start += size
    pending = _Pending()
    for index, m in enumerate(linears):
        m.forward = _member_forward(m, index, len(linears) - 1, weight, bias, sizes, pending)
        setattr(m, FUSED_ATTR, True)
    return True


def can_fuse(model) -> bool:
    """Whether fuse_projections would fuse anything: some layer has a group of plain nn.Linear
    members of one input size, dtype and device (Llama, Mistral, Qwen2 have two per layer)."""
    if not can_compile(model):
        return False
    return any((linears := _group(layer, attr, names)) is not None and _fusable(linears)
               for layer in decoder_layers(model) for attr, names in GROUPS)


def fuse_projections(model) -> int:
    """Fuse q/k/v and gate/up in every decoder layer (in place); returns how many groups are fused.
    Groups that are not plain nn.Linear modules of one input size, dtype and device stay as they are."""
    layers = decoder_layers(model, wanted_by="fuse_projections=True")
    fused = 0
    for layer in layers:
        for attr, names in GROUPS:
            linears = _group(layer, attr, names)
            fused += linears is not None and _fuse_group(linears)
    if not fused:
        raise ConfigError(f"fuse_projections=True found nothing to fuse in {type(model).__name__}: its layers have "
                          "no plain nn.Linear q_proj/k_proj/v_proj or gate_proj/up_proj (Llama, Mistral, Qwen2 do)")
    logger.info("fused %d projection groups (q/k/v, gate/up) in %d layers", fused, len(layers))
    return fused


def unfuse_projections(model) -> None:
    """Undo fuse_projections: every member runs its own GEMM again (its weight stays a view)."""
    if not can_compile(model):
        return  # no layers list: nothing was fused
    for layer in decoder_layers(model):
        for attr, names in GROUPS:
            for member in _group(layer, attr, names) or []:
                if vars(member).pop(FUSED_ATTR, None):
                    vars(member).pop("forward", None)
