"""Ponytail: a paged KV cache for LLM serving that does not run out of GPU memory.

The names users need live here; everything else is internal.
"""

from .block_allocator import Allocation, NoRoom
from .config import CacheConfig
from .create import create_cache
from .errors import ConfigError, KernelError, PonytailError
from .estimate import KVEstimate, estimate_kv_cache
from .paged_cache import CacheStats, DefragResult, PagedKVCache

__version__ = "0.1.0"

__all__ = [
    "Allocation",
    "CacheConfig",
    "CacheStats",
    "ConfigError",
    "DefragResult",
    "KVEstimate",
    "KernelError",
    "NoRoom",
    "PagedKVCache",
    "PonytailError",
    "create_cache",
    "estimate_kv_cache",
]
