"""Ponytail: a paged KV cache for LLM serving that does not run out of GPU memory.

The names users need live here; everything else is internal.
"""

from .utils.compat import check_transformers

check_transformers()

from .kv.blocks import Allocation, NoRoom, prefix_block_hashes  # noqa: E402
from .kv.prefix_events import PrefixEvent, PrefixEventLog  # noqa: E402
from .kv.config import DEFAULT_BLOCK_SIZE, CacheConfig  # noqa: E402
from .config import EngineConfig  # noqa: E402
from .plugin.create import create_cache  # noqa: E402
from .errors import ConfigError, ContextLengthError, EngineDeadError, KernelError, PonytailError  # noqa: E402
from .kv.estimate import KVEstimate, estimate_kv_cache  # noqa: E402
from .async_llm import AsyncLLM, RequestDelta  # noqa: E402
from .plugin.cache import PonytailCache  # noqa: E402
from .llm import LLM  # noqa: E402
from .process_llm import ProcessAsyncLLM  # noqa: E402
from .engine.stats import EngineStats  # noqa: E402
from .models.loader import load_model, load_tokenizer, prefetch_model  # noqa: E402
from .models.chat_template import check_chat_template_options, is_chat_template, render_chat  # noqa: E402
from .kv.paged_cache import CacheStats, DefragResult, PagedKVCache  # noqa: E402
from .engine.request import CompletionOutput, RequestOutput  # noqa: E402
from .engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence  # noqa: E402
from .sampling.logprob import Logprob, TokenTexts  # noqa: E402
from .sampling.params import SamplingParams  # noqa: E402
from .sampling.structured import StructuredOutputsParams  # noqa: E402
from .utils.units import is_seconds  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLM",
    "ProcessAsyncLLM",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
    "Logprob",
    "TokenTexts",
    "StructuredOutputsParams",
    "check_chat_template_options",
    "is_chat_template",
    "render_chat",
    "Allocation",
    "CacheConfig",
    "CacheStats",
    "ConfigError",
    "DEFAULT_BLOCK_SIZE",
    "ContextLengthError",
    "DefragResult",
    "EngineDeadError",
    "KVEstimate",
    "KernelError",
    "NoRoom",
    "PagedKVCache",
    "PonytailCache",
    "PonytailError",
    "PrefixEvent",
    "PrefixEventLog",
    "create_cache",
    "estimate_kv_cache",
    "is_seconds",
    "load_model",
    "load_tokenizer",
    "prefetch_model",
    "prefix_block_hashes",
]
