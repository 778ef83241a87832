"""The skinny GEMM kernel (cuda_kernels/skinny_gemm.cu) against float32 products, on CUDA; what it
refuses, everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ponytail.kernels import skinny_gemm

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the skinny GEMM kernel needs a CUDA device")


def column_major(weight: torch.Tensor) -> torch.Tensor:
    return weight.t().contiguous().t()


def test_refusals_say_why():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w = column_major(torch.zeros(128, 64, dtype=torch.bfloat16))
    assert skinny_gemm.unsupported(x, w) == "x is on cpu, not CUDA"


@cuda
@pytest.mark.gpu
def test_refusals_on_cuda_name_the_shape_layout_and_dtype():
    device = torch.device("cuda")
    skinny_gemm.prepare(device, 256)
    x = torch.randn(4, 64, dtype=torch.bfloat16, device=device)
    w = column_major(torch.randn(128, 64, dtype=torch.bfloat16, device=device))
    assert skinny_gemm.unsupported(x, w) is None
    assert skinny_gemm.unsupported(torch.randn(17, 64, dtype=torch.bfloat16, device=device), w) == \
        "17 rows (the kernel takes 1 to 16)"
    assert skinny_gemm.unsupported(x, w.contiguous()) == "the weight is not column-major with 16-byte aligned columns"
    assert skinny_gemm.unsupported(x.float(), w.float()).startswith("dtypes x torch.float32")
    odd = column_major(torch.randn(96, 64, dtype=torch.bfloat16, device=device))
    assert skinny_gemm.unsupported(x, odd) == "weight [96, 64]: out_features must divide by 64 and in_features by 16"
    wide = column_major(torch.randn(512, 64, dtype=torch.bfloat16, device=device))
    assert skinny_gemm.unsupported(x, wide) == \
        "no workspace for 512 columns on cuda:0 (prepare was not called for it)"


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("shape", [(4096, 4096), (12288, 4096), (4096, 11008), (960, 576), (3072, 576)])
def test_matches_float32_at_every_split(dtype, rows, shape):
    n, k = shape
    device = torch.device("cuda")
    skinny_gemm.prepare(device, n)
    gen = torch.Generator(device=device).manual_seed(rows * 31 + n)
    x = torch.randn(rows, k, device=device, dtype=dtype, generator=gen)
    w = column_major(torch.randn(n, k, device=device, dtype=dtype, generator=gen) / k ** 0.5)
    expected = x.float() @ w.float().t()
    reference = F.linear(x, w).float()  # cuBLAS: how far bf16 / fp16 output rounding moves a product
    bound = 2 * (reference - expected).abs().max().item() + 1e-3
    for splits in (None, 1, 2, 5, 8):
        for unroll in (2, 4):
            for _ in range(2):  # the second launch finds the tile counters reset by the first
                got = skinny_gemm.skinny_linear(x, w, splits=splits, unroll=unroll).float()
                error = (got - expected).abs().max().item()
                assert error <= bound, (splits, unroll, error, bound)


@cuda
@pytest.mark.gpu
def test_replays_in_a_cuda_graph_with_new_inputs():
    device = torch.device("cuda")
    n, k = 4096, 4096
    skinny_gemm.prepare(device, n)
    w = column_major(torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5)
    x = torch.randn(5, k, device=device, dtype=torch.bfloat16)
    skinny_gemm.skinny_linear(x, w)  # compiled outside the capture
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = skinny_gemm.skinny_linear(x, w, splits=4)
    torch.cuda.synchronize()
    for seed in range(3):
        gen = torch.Generator(device).manual_seed(seed)
        x.copy_(torch.randn(5, k, device=device, dtype=torch.bfloat16, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        expected = x.float() @ w.float().t()
        assert (out.float() - expected).abs().max().item() < 0.05
