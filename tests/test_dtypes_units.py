"""dtype names and byte sizes: what users may write, and the errors for anything else."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ponytail.utils.dtypes import dtype_name, dtype_size, resolve_dtype
from ponytail.errors import ConfigError
from ponytail.utils.units import format_bytes, format_bytes_binary, parse_bytes

ALLOWED = "allowed: bfloat16, float16, float32 (aliases: bf16, fp16, half, fp32, float)"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("float16", torch.float16), ("fp16", torch.float16), ("half", torch.float16),
        ("torch.float16", torch.float16), ("FP16", torch.float16),
        ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
        ("float32", torch.float32), ("fp32", torch.float32), ("float", torch.float32),
        ("torch.float32", torch.float32), ("torch.float", torch.float32),
        ("torch.half", torch.float16),
        (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
    ],
)
def test_resolve_dtype_accepts_names_and_aliases(value, expected):
    assert resolve_dtype(value) is expected


def test_resolve_dtype_error_names_field_value_and_allowed():
    with pytest.raises(ConfigError) as err:
        resolve_dtype("float17")
    assert str(err.value) == f"dtype='float17' is not supported; {ALLOWED}"


@pytest.mark.parametrize("value", [torch.float64, torch.int8, 16, None, "float64", "fp8"])
def test_resolve_dtype_rejects_other_dtypes_and_types(value):
    with pytest.raises(ConfigError, match=r"is not supported; allowed: bfloat16"):
        resolve_dtype(value)


def test_resolve_dtype_uses_given_field_name():
    with pytest.raises(ConfigError, match=r"^kv_dtype=torch.float64 is not supported"):
        resolve_dtype(torch.float64, field="kv_dtype")


def test_dtype_name_and_size():
    assert dtype_name(torch.float16) == "float16"
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert [dtype_size(d) for d in (torch.float16, torch.bfloat16, torch.float32)] == [2, 2, 4]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (123, 123), ("123", 123), ("123B", 123),
        ("4GiB", 4 * 1024**3), ("4 gib", 4 * 1024**3), ("512 MiB", 512 * 1024**2),
        ("1KiB", 1024), ("2TiB", 2 * 1024**4),
        ("80GB", 80 * 10**9), ("80gb", 80 * 10**9), ("1kb", 1000), ("3 MB", 3 * 10**6),
        ("1.5TB", 1_500_000_000_000), ("1.1GB", 1_100_000_000), ("1.5 KiB", 1536),
        (" 7 GB ", 7 * 10**9),
    ],
)
def test_parse_bytes_accepts(value, expected):
    assert parse_bytes(value, "memory_budget") == expected


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (0, "is not positive"), (-5, "is not positive"), (True, "is not a byte size"),
        (1.5, "is not a byte size"), ("", "is not a byte size"), ("4 GiBs", "is not a byte size"),
        ("GB", "is not a byte size"), ("-4GB", "is not a byte size"),
        ("4 PB", "is not a byte size"),
        ("0.1", "is less than one byte"), ("0GB", "is less than one byte"),
    ],
)
def test_parse_bytes_error_names_field_value_and_forms(value, why):
    with pytest.raises(ConfigError) as err:
        parse_bytes(value, "gpu_memory")
    message = str(err.value)
    assert message.startswith(f"gpu_memory={value!r} {why}; allowed: a positive int of bytes")
    assert "'4GiB'" in message and "KiB/MiB/GiB/TiB powers of 1024" in message


@given(st.integers(min_value=1, max_value=10**6), st.sampled_from(
    [("", 1), ("KB", 1000), ("MiB", 1024**2), ("gb", 1000**3), ("TiB", 1024**4)]))
def test_parse_bytes_integer_with_unit(n, unit):
    suffix, factor = unit
    assert parse_bytes(f"{n}{suffix}", "x") == n * factor
    assert parse_bytes(f"{n} {suffix}", "x") == n * factor


@pytest.mark.parametrize(
    ("n", "decimal", "binary"),
    [
        (8_589_934_592, "8.6 GB", "8.0 GiB"),
        (0, "0 B", "0 B"),
        (999, "999 B", "999 B"),
        (1000, "1.0 KB", "1000 B"),
        (1024, "1.0 KB", "1.0 KiB"),
        (80 * 10**9, "80.0 GB", "74.5 GiB"),
        (999_950_000, "1.0 GB", "953.6 MiB"),  # rounds up into the next unit, not "1000.0 MB"
        (3 * 10**18, "3.0 EB", "2.6 EiB"),
    ],
)
def test_format_bytes(n, decimal, binary):
    assert format_bytes(n) == decimal
    assert format_bytes_binary(n) == binary
