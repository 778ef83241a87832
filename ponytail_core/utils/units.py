"""Byte sizes as users write them ("4GiB", "80 GB") and as we print them ("8.6 GB"); durations checked."""

from __future__ import annotations

import math
import re
from fractions import Fraction

from ..errors import ConfigError

# Unit (lower case) -> bytes. Decimal units are powers of 1000, binary ones powers of 1024.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)

_FORMS = (
    "a positive int of bytes, or a string such as '123', '512 MiB', '4GiB', '80GB', '1.5TB' "
    "(KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024)"
)

_DECIMAL = ("B", "KB", "MB", "GB", "TB", "PB", "EB")
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def parse_bytes(value: object, field: str) -> int:
    """Parse a positive byte count: an int, or a number with an optional unit ("4GiB", "80 GB").

    Fractional results are rounded down to whole bytes ("1.5 KiB" -> 1536).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value > 0:
            return value
        raise ConfigError(f"{field}={value!r} is not positive; allowed: {_FORMS}")
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match and match.group(2).lower() in _UNITS:
            n = int(Fraction(match.group(1)) * _UNITS[match.group(2).lower()])
            if n > 0:
                return n
            raise ConfigError(f"{field}={value!r} is less than one byte; allowed: {_FORMS}")
    raise ConfigError(f"{field}={value!r} is not a byte size; allowed: {_FORMS}")


def _format(n: int, base: int, units: tuple[str, ...]) -> str:
    if abs(n) < base:
        return f"{n} B"
    value = float(n)
    for unit in units[1:]:
        value /= base
        # Promote when rounding would print e.g. "1000.0 MB".
        if abs(round(value, 1)) < base or unit == units[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def format_bytes(n: int) -> str:
    """Decimal units with one decimal: 8589934592 -> "8.6 GB"; below 1000 bytes -> "512 B"."""
    return _format(n, 1000, _DECIMAL)


def format_bytes_binary(n: int) -> str:
    """Binary units with one decimal: 8589934592 -> "8.0 GiB"; below 1024 bytes -> "512 B"."""
    return _format(n, 1024, _BINARY)


def is_seconds(value: object, most: float = math.inf) -> bool:
    """A finite duration from 0 to `most` seconds (an int or float; bool is not a number here)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and 0 <= value <= most)
