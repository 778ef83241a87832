"""Integer arithmetic the block math repeats everywhere."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers (b > 0), without going through floats: blocks for `a` tokens of `b`."""
    return -(-a // b)
