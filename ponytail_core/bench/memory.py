"""Memory over time: a thread samples the device (or the process, on the CPU) every few
milliseconds, and stamps each sample with the latest KV-pool snapshot the engine loop published,
so device memory and the pool share one time axis."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger("ponytail.bench")


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """Ponytail's KV pool after an engine step."""

    pool_bytes: int  # device memory the pool holds
    used_bytes: int  # blocks held by live requests, in bytes
    live_token_bytes: int  # what the running requests' tokens need, without rounding to blocks
    running: int  # requests running
    waiting: int  # requests waiting for room


@dataclass(frozen=True, slots=True)
class MemorySample:
    side: str  # "generate" or "ponytail"
    t: float  # seconds since the side started
    device_used: int | None  # NVML: memory in use on the whole device (every process)
    allocated: int | None  # torch's allocator: bytes in live tensors (CUDA)
    reserved: int | None  # torch's allocator: bytes it holds from the device (CUDA)
    rss: int | None  # the process's resident memory (CPU runs)
    pool: PoolSnapshot | None  # Ponytail's pool at that moment (None for plain generate)


class DeviceProbe:
    """Reads memory for one device: NVML where nvidia-ml-py and a driver are present, torch's
    allocator counters always on CUDA, the process's RSS on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.source = "process RSS"
        self._nvml = None
        self._handle = None
        if device.type == "cuda":
            self.source = "torch allocator"
            self._open_nvml()

    def _open_nvml(self) -> None:
        try:
            import pynvml  # nvidia-ml-py; optional
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
            self._handle = _nvml_handle(pynvml, self.device)
        except pynvml.NVMLError as exc:
            logger.info("NVML unavailable (%s): device memory from torch's allocator only", exc)
            return
        self._nvml = pynvml
        self.source = "NVML + torch allocator"

    def read(self) -> tuple[int | None, int | None, int | None, int | None]:
        """(device_used, allocated, reserved, rss); None where this device has no such count."""
        if self.device.type != "cuda":
            return None, None, None, _rss()
        used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used if self._nvml else None
        return (used, torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device), None)

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None


def _nvml_handle(pynvml, device: torch.device):
    """NVML's handle for torch's device, by UUID (CUDA_VISIBLE_DEVICES renumbers devices)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except pynvml.NVMLError:
            pass
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def _rss() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:  # Linux without psutil: /proc has it in pages
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemorySampler:
    """Samples `probe` every `interval_s` on a daemon thread between start() and stop().

    The engine loop calls publish() after each step; the thread only reads that reference
    (one assignment, so no lock), never the engine's structures."""

    def __init__(self, probe: DeviceProbe, interval_s: float = 0.05):
        self.probe = probe
        self.interval_s = interval_s
        self.samples: list[MemorySample] = []
        self._pool: PoolSnapshot | None = None
        self._side = ""
        self._t0 = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def publish(self, snapshot: PoolSnapshot) -> None:
        self._pool = snapshot

    def start(self, side: str, pool: PoolSnapshot | None = None) -> None:
        """Start sampling a side; pool: its KV pool before the first step (Ponytail's side)."""
        self._side, self._pool, self._t0 = side, pool, time.perf_counter()
        self._stop.clear()
        self.sample()  # the state before the side's first step
        self._thread = threading.Thread(target=self._run, name=f"ponytail-bench-memory-{side}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.sample()  # the state at the end

    def sample(self) -> None:
        used, allocated, reserved, rss = self.probe.read()
        self.samples.append(MemorySample(self._side, time.perf_counter() - self._t0, used, allocated,
                                         reserved, rss, self._pool))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()
