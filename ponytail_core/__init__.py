"""Ponytail: a paged KV cache for LLM serving that does not run out of GPU memory.

The names users need live here; everything else is internal.
"""

from .compat import check_transformers

check_transformers()

from .block_allocator import Allocation, NoRoom  # noqa: E402
from .config import CacheConfig  # noqa: E402
from .create import create_cache  # noqa: E402
from .errors import ConfigError, KernelError, PonytailError  # noqa: E402
from .estimate import KVEstimate, estimate_kv_cache  # noqa: E402
from .async_engine import AsyncLLM, RequestDelta  # noqa: E402
from .hf_cache import PonytailCache  # noqa: E402
from .llm import LLM  # noqa: E402
from .llm_engine import EngineStats  # noqa: E402
from .model_loader import load_model  # noqa: E402
from .paged_cache import CacheStats, DefragResult, PagedKVCache  # noqa: E402
from .request import CompletionOutput, RequestOutput  # noqa: E402
from .sampling_params import SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AsyncLLM",
    "CompletionOutput",
    "EngineStats",
    "LLM",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
    "Allocation",
    "CacheConfig",
    "CacheStats",
    "ConfigError",
    "DefragResult",
    "KVEstimate",
    "KernelError",
    "NoRoom",
    "PagedKVCache",
    "PonytailCache",
    "PonytailError",
    "create_cache",
    "estimate_kv_cache",
    "load_model",
]
