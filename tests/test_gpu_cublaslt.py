"""cuBLASLt by a chosen algorithm (benchmarks/cublaslt.py, probe_gemm's lt_* methods) against float32
products, on CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from cublaslt import LtLinear  # noqa: E402

sys.path.remove(str(Path(__file__).resolve().parents[1] / "benchmarks"))

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt needs a CUDA device")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,in_features,out_features", [(1, 256, 384), (64, 512, 1024), (100, 1024, 256)])
def test_every_listed_algorithm_computes_the_product(dtype, rows, in_features, out_features):
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(rows)
    x = torch.randn(rows, in_features, device=device, dtype=dtype, generator=gen)
    weight = torch.randn(out_features, in_features, device=device, dtype=dtype, generator=gen) / in_features ** 0.5
    expected = x.float() @ weight.float().t()
    lt = LtLinear(rows, in_features, out_features, dtype, device)
    algos = lt.algorithms()
    assert algos and algos[0].index == 0
    out = torch.empty(rows, out_features, device=device, dtype=dtype)
    for algo in algos:
        out.fill_(float("nan"))
        got = lt(algo, x, weight.t().contiguous(), out).float()
        error = ((got - expected).norm() / expected.norm()).item()
        assert error < 1e-2, f"{algo.label}: relative error {error:.2e}"


@cuda
@pytest.mark.gpu
def test_wrong_shapes_and_layouts_are_refused_with_what_was_expected():
    device = torch.device("cuda")
    lt = LtLinear(4, 64, 128, torch.bfloat16, device)
    algo = lt.algorithms()[0]
    x = torch.zeros(4, 64, device=device, dtype=torch.bfloat16)
    w_t = torch.zeros(64, 128, device=device, dtype=torch.bfloat16)
    out = torch.empty(4, 128, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x \(5, 64\).*takes \(4, 64\), \(64, 128\), \(4, 128\)"):
        lt(algo, torch.zeros(5, 64, device=device, dtype=torch.bfloat16), w_t, out)
    with pytest.raises(ValueError, match="must be contiguous"):
        lt(algo, x, torch.zeros(128, 64, device=device, dtype=torch.bfloat16).t(), out)
    with pytest.raises(ValueError, match="dtype torch.int8"):
        LtLinear(4, 64, 128, torch.int8, device)
