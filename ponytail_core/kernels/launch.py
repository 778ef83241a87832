"""Launch helpers shared by the kernel wrappers."""

from __future__ import annotations

from ..errors import KernelError

VECTOR_WIDTHS = (16, 8, 4, 2)  # bytes per load/store the kernels are instantiated for


def vector_width(*sizes: int) -> int:
    """Widest vector (bytes) dividing every size, stride and address given."""
    for width in VECTOR_WIDTHS:
        if all(s % width == 0 for s in sizes):
            return width
    raise KernelError(f"no vector width in {VECTOR_WIDTHS} divides {sizes}; rows must be 2-byte aligned")
