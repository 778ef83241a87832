"""Choosing between custom CUDA kernels and their torch fallbacks, and loading the kernels.

Custom kernels are `.cu` files in `cuda_kernels/`, compiled by CuPy's `RawModule` (NVRTC) at
first use and cached per device. Which path runs is decided once per device:
  * PONYTAIL_KERNELS=torch   - always the torch fallback;
  * PONYTAIL_KERNELS=cupy    - always the custom kernel; an error if it cannot run;
  * unset or "auto"          - the custom kernel on a CUDA device with CuPy importable,
                               else the fallback.
The choice is logged once per operation at INFO and at every call at DEBUG, with its reason.
A kernel that fails to compile raises: a broken kernel never hides behind the fallback.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import logging
import re
import os
from dataclasses import dataclass

import torch

from ..errors import ConfigError, KernelError

logger = logging.getLogger("ponytail.kernels")

KERNELS_ENV = "PONYTAIL_KERNELS"
_MODES = ("auto", "cupy", "torch")


@dataclass(frozen=True, slots=True)
class KernelChoice:
    use_custom: bool
    reason: str

    @property
    def label(self) -> str:
        return "custom kernel" if self.use_custom else "fallback"


def kernel_mode() -> str:
    mode = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ConfigError(f"{KERNELS_ENV}={mode!r} is not supported; allowed: {', '.join(_MODES)}")
    return mode


def _cupy_import_error() -> str | None:
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA runtime mismatch raised at import
        return f"CuPy is not importable ({type(exc).__name__}: {exc})"
    return None


def choose(device: torch.device) -> KernelChoice:
    """Custom kernel or fallback for work on `device`, and why."""
    mode = kernel_mode()
    if mode == "torch":
        return KernelChoice(False, f"{KERNELS_ENV}=torch")
    if device.type != "cuda":
        if mode == "cupy":
            raise KernelError(f"{KERNELS_ENV}=cupy but the cache is on {device}, not a CUDA device")
        return KernelChoice(False, f"device is {device}, not CUDA")
    problem = _cupy_import_error()
    if problem is not None:
        if mode == "cupy":
            raise KernelError(f"{KERNELS_ENV}=cupy but {problem}")
        return KernelChoice(False, problem)
    return KernelChoice(True, f"CuPy RawModule on {device}")


_logged: set[tuple[str, KernelChoice]] = set()


def log_choice(op: str, choice: KernelChoice) -> None:
    if (op, choice) not in _logged:
        _logged.add((op, choice))
        logger.info("%s: %s (%s)", op, choice.label, choice.reason)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s: %s (%s)", op, choice.label, choice.reason)


def kernel_source(filename: str, defines: tuple[str, ...] = ()) -> str:
    """Source of a `.cu` file, after `#define`s of `defines` (one file, several modules: e.g.
    paged_attention.cu's windowed kernels) and #line so compiler errors name the real file. Its
    `#include "x.cuh"` lines are replaced by those headers' text, so the source CuPy caches the
    compiled module under changes whenever a header does."""
    return "".join(f"#define {name}\n" for name in defines) + _with_headers(filename)


def _with_headers(filename: str) -> str:
    resource = importlib.resources.files("ponytail.cuda_kernels").joinpath(filename)
    lines = [f'#line 1 "{resource}"']
    for number, line in enumerate(resource.read_text().splitlines(), start=1):
        header = _INCLUDE.match(line)
        if header is None:
            lines.append(line)
        else:
            lines += [_with_headers(header.group(1)), f'#line {number + 1} "{resource}"']
    return "\n".join(lines) + "\n"


_INCLUDE = re.compile(r'^#include "([\w.]+\.cuh)"\s*$')


@functools.cache
def load_module(filename: str, device_index: int, defines: tuple[str, ...] = ()):
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=kernel_source(filename, defines), options=("--std=c++17",))
        try:
            module.compile()
        except Exception as exc:
            what = filename + "".join(f" -D{name}" for name in defines)
            raise KernelError(f"compiling {what} for cuda:{device_index} failed: {exc}") from exc
    return module


def get_kernel(filename: str, name: str, device: torch.device, defines: tuple[str, ...] = ()):
    return _function(filename, name, device.index, defines)


@functools.cache
def _function(filename: str, name: str, device_index: int, defines: tuple[str, ...] = ()):
    return load_module(filename, device_index, defines).get_function(name)


_cupy_streams: dict[tuple[int, int], object] = {}


def _cupy_stream(stream: torch.cuda.Stream):
    """CuPy's handle on a torch stream, made once per stream (creating one per launch costs)."""
    import cupy

    key = (stream.device.index, stream.cuda_stream)
    handle = _cupy_streams.get(key)
    if handle is None:
        if hasattr(cupy.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
            handle = cupy.cuda.Stream.from_external(stream)  # CuPy >= 14
        else:
            handle = cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index)
        _cupy_streams[key] = handle
    return handle


@contextlib.contextmanager
def on_torch_stream(device: torch.device):
    """Launch CuPy kernels on the device and stream torch is using, so ordering is preserved."""
    import cupy

    with cupy.cuda.Device(device.index), _cupy_stream(torch.cuda.current_stream(device)):
        yield
