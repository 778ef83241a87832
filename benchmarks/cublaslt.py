"""cuBLASLt's matmul by a chosen algorithm, through ctypes on the library torch already loaded
(probe_gemm.py's lt_best and lt_first methods).

torch's cuBLASLt path asks the heuristic for one algorithm and runs it. For the skinny products of
decode steps (tens of rows against a 7B's weights) that pick might not be the fastest of those the
heuristic lists: this module lists them and runs any of them, so the probe can time each. On an
H100 (docs/benchmarks.md, thirty-sixth session) the heuristic listed 8 and the best of them ran a
forward pass's GEMMs as fast as its first pick at 64 rows and 1.8% faster at 16, so the engine keeps
torch's path. CuPy binds cuBLAS but not cuBLASLt, hence ctypes.

The product is F.linear(x, weight) with the weight stored column-major (runner/gemm_layout.py):
x [M, K] row-major, weight_t = weight.T [K, N] row-major, out [M, N] row-major. In cuBLAS's
column-major terms that is out^T [N, M] = weight [N, K] @ x^T [K, M], no transposes.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_CUDA_R_32F = 0
_DATA_TYPES = {torch.bfloat16: 14, torch.float16: 2, torch.float32: 0}  # cudaDataType_t
_PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t
_CONFIG_ATTRS = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "stages": 6}
WORKSPACE_BYTES = 32 << 20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@dataclass(frozen=True, slots=True)
class LtAlgo:
    """One algorithm the heuristic returned, with the numbers that tell it apart."""

    index: int  # its rank in the heuristic's list (0: what torch runs)
    raw: bytes
    workspace_size: int
    waves: float
    config: dict

    @property
    def label(self) -> str:
        c = self.config
        return (f"#{self.index} id{c['id']} tile{c['tile']} k{c['splitk']} red{c['reduction']} "
                f"sw{c['swizzle']} st{c['stages']} waves {self.waves:.2f}")


def _library_path() -> str:
    torch.cuda.init()
    torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")  # loads cuBLAS(Lt)
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(" ", 1)[-1].strip()
            if "libcublasLt.so" in path:
                return path
    raise RuntimeError("libcublasLt is not loaded in this process after a CUDA matmul")


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(_library_path())
    for name in ("cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatrixLayoutCreate",
                 "cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceSetAttribute",
                 "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul", "cublasLtMatmulAlgoConfigGetAttribute"):
        getattr(lib, name).restype = ctypes.c_int
    lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                                               ctypes.c_uint64, ctypes.c_int64]
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} returned cuBLAS status {status}")


@functools.cache
def _handle(device_index: int) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        _check(_lib().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@functools.cache
def _workspace(device: torch.device) -> torch.Tensor:
    """One workspace per device, shared by every product (the probe runs them one at a time)."""
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


class LtLinear:
    """out = x @ weight_t for one shape (rows, in, out) and dtype, by any algorithm of its list."""

    def __init__(self, rows: int, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device):
        if dtype not in _DATA_TYPES:
            raise ValueError(f"dtype {dtype}: cuBLASLt here takes {', '.join(map(str, _DATA_TYPES))}")
        lib = _lib()
        self.device = device
        self.shape = (rows, in_features, out_features)
        self._handle = _handle(device.index if device.index is not None else torch.cuda.current_device())
        self._desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _COMPUTE_32F, _CUDA_R_32F), "MatmulDescCreate")
        dt = _DATA_TYPES[dtype]
        self._a, self._b, self._d = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._a), dt, out_features, in_features, out_features), "A")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._b), dt, in_features, rows, in_features), "B")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._d), dt, out_features, rows, out_features), "D")
        self._pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self._pref)), "PreferenceCreate")
        limit = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(self._pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit),
                                                        ctypes.sizeof(limit)), "PreferenceSetAttribute")
        self.workspace = _workspace(device)
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def algorithms(self, count: int = 32) -> list[LtAlgo]:
        """The heuristic's list, best guess first."""
        results = (_Heuristic * count)()
        returned = ctypes.c_int()
        _check(_lib().cublasLtMatmulAlgoGetHeuristic(self._handle, self._desc, self._a, self._b, self._d, self._d,
                                                      self._pref, count, results, ctypes.byref(returned)),
               "MatmulAlgoGetHeuristic")
        algos = []
        for i in range(returned.value):
            r = results[i]
            if r.state != 0:
                continue
            algos.append(LtAlgo(i, bytes(r.algo), r.workspace_size, r.waves_count, _config(r.algo)))
        return algos

    def __call__(self, algo: LtAlgo, x: torch.Tensor, weight_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        rows, k, n = self.shape
        if x.shape != (rows, k) or weight_t.shape != (k, n) or out.shape != (rows, n):
            raise ValueError(f"shapes x {tuple(x.shape)}, weight_t {tuple(weight_t.shape)}, out {tuple(out.shape)}: "
                             f"this product takes ({rows}, {k}), ({k}, {n}), ({rows}, {n})")
        if not (x.is_contiguous() and weight_t.is_contiguous() and out.is_contiguous()):
            raise ValueError("x, weight_t and out must be contiguous (row-major)")
        raw = _Algo.from_buffer_copy(algo.raw)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        _check(_lib().cublasLtMatmul(self._handle, self._desc, ctypes.byref(self._alpha),
                                     ctypes.c_void_p(weight_t.data_ptr()), self._a,
                                     ctypes.c_void_p(x.data_ptr()), self._b, ctypes.byref(self._beta),
                                     ctypes.c_void_p(out.data_ptr()), self._d, ctypes.c_void_p(out.data_ptr()),
                                     self._d, ctypes.byref(raw), ctypes.c_void_p(self.workspace.data_ptr()),
                                     ctypes.c_size_t(WORKSPACE_BYTES), ctypes.c_void_p(stream)), "Matmul")
        return out


def _config(algo: _Algo) -> dict:
    lib = _lib()
    config = {}
    for name, attr in _CONFIG_ATTRS.items():
        value, written = ctypes.c_uint32(), ctypes.c_size_t()
        status = lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value),
                                                          ctypes.sizeof(value), ctypes.byref(written))
        config[name] = value.value if status == 0 else None
    return config
