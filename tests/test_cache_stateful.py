import pytest
import torch
from hypothesis import HealthCheck, settings

from cache_machine import CacheMachine

SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class CpuCacheMachine(CacheMachine):
    DEVICE = "cpu"
    DTYPE = torch.float32
    MODES = ("torch",)


class CpuBf16CacheMachine(CacheMachine):
    DEVICE = "cpu"
    DTYPE = torch.bfloat16
    MODES = ("torch",)


class GpuCacheMachine(CacheMachine):
    """The CuPy kernels and the torch fallback in lockstep on the GPU, compared bit for bit."""

    DEVICE = "cuda"
    DTYPE = torch.bfloat16
    MODES = ("cupy", "torch")


TestCpuCache = CpuCacheMachine.TestCase
TestCpuCache.settings = SETTINGS
TestCpuBf16Cache = CpuBf16CacheMachine.TestCase
TestCpuBf16Cache.settings = settings(SETTINGS, max_examples=20)


@pytest.mark.gpu
def test_gpu_kernels_match_fallback_bit_for_bit():
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(GpuCacheMachine, settings=settings(SETTINGS, max_examples=100))
