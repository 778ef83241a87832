"""Ponytail: a paged KV cache for LLM serving that does not run out of GPU memory.

The names users need live here; everything else is internal.
"""

from .utils.compat import check_transformers

check_transformers()

from .kv.blocks import Allocation, NoRoom  # noqa: E402
from .kv.config import CacheConfig  # noqa: E402
from .plugin.create import create_cache  # noqa: E402
from .errors import ConfigError, KernelError, PonytailError  # noqa: E402
from .kv.estimate import KVEstimate, estimate_kv_cache  # noqa: E402
from .async_llm import AsyncLLM, RequestDelta  # noqa: E402
from .plugin.cache import PonytailCache  # noqa: E402
from .llm import LLM  # noqa: E402
from .engine.llm_engine import EngineStats  # noqa: E402
from .models.loader import load_model  # noqa: E402
from .kv.paged_cache import CacheStats, DefragResult, PagedKVCache  # noqa: E402
from .engine.request import CompletionOutput, RequestOutput  # noqa: E402
from .sampling.params import SamplingParams  # noqa: E402
from .sampling.structured import StructuredOutputsParams  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AsyncLLM",
    "CompletionOutput",
    "EngineStats",
    "LLM",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
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
