"""The transformers `Cache` base both of Ponytail's caches build on: the engine's packed-step cache
(runner/step_cache.py) and the plug-in's `PonytailCache` (plugin/cache.py).

`update()` does not hand full K/V back to the model: it tags the new tokens' K/V with the cache
(`TAG`), and Ponytail's attention function (hf_backend.py) finds the cache there and calls its
`attend`, which writes them into their slots and reads the context straight from the blocks.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import ConfigError
from ..kernels import loader as kernel_loader
from ..kv.config import CacheConfig
from ..kv.paged_cache import PagedKVCache

TAG = "_ponytail_cache"  # attribute set on the key tensor update() returns
# Where a compiled layer's attention module keeps its index (runner/compile.py sets it; the index
# the traced code passes to update() is then 0 in every layer).
LAYER_INDEX_ATTR = "_ponytail_layer_idx"


class _PagedLayer(CacheLayerMixin):
    """Per-layer view transformers expects; the pool holds the data for all layers."""

    is_compileable = False
    supports_early_init = False

    def __init__(self, owner: PagedCacheBase, layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.seen_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.seen_tokens

    def get_max_length(self) -> int:
        return self.owner.paged.config.max_seq_len


class PagedCacheBase(Cache):
    """What both transformers-facing caches share: layer views, tagging in update(), model checks."""

    def __init__(self, paged: PagedKVCache):
        self.paged = paged
        self._awaiting_attention: int | None = None
        self._torch_path = True  # attention runs in torch (not the CUDA kernels); set at each step's layer 0
        super().__init__(layers=[_PagedLayer(self, i) for i in range(paged.config.num_layers)])

    @property
    def config(self) -> CacheConfig:
        return self.paged.config

    seen_tokens = 0  # positions the model has seen per row (what transformers counts)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._awaiting_attention is not None:
            raise ConfigError(
                "the model's attention implementation did not consume layer "
                f"{self._awaiting_attention}'s K/V: a Ponytail cache needs attn_implementation='ponytail'. "
                "Build the cache with ponytail.create_cache(model=model, ...), which sets it, or call "
                "model.set_attn_implementation('ponytail')")
        self._awaiting_attention = layer_idx
        setattr(key_states, TAG, (self, layer_idx))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.config.max_seq_len

    @property
    def is_compileable(self) -> bool:
        return False

    def _unsupported(self, what: str):
        raise NotImplementedError(f"{what} is not supported by the Ponytail cache yet (greedy, sampled, "
                                  "beam-search and assisted generation are, num_return_sequences too)")

    def reorder_cache(self, beam_idx):
        self._unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int):
        self._unsupported("assisted decoding (crop)")

    def batch_repeat_interleave(self, repeats: int):
        self._unsupported("num_return_sequences > 1 (batch_repeat_interleave)")

    def batch_select_indices(self, indices):
        self._unsupported("batch_select_indices")

    def attend(self, layer_idx: int, module, query, key, value, attention_mask, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        """Write this layer's new K/V and return attention output [B, T, Hq, D]."""
        raise NotImplementedError

    def attend_or_abandon(self, layer_idx: int, module, query, key, value, attention_mask, scale: float,
                          sliding_window: int | None) -> torch.Tensor:
        """attend(), and abandon_step() if it raises: a failed forward pass leaves no half-written step."""
        try:
            return self.attend(layer_idx, module, query, key, value, attention_mask, scale, sliding_window)
        except BaseException:
            self.abandon_step()
            raise

    def abandon_step(self) -> None:
        """A forward pass failed inside attention: undo what would leave the cache inconsistent."""
        self._awaiting_attention = None

    def write_new_kv(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
        """key/value [B, Hkv, T, D] as the model made them (strided views, no copy)."""
        keys = key.permute(0, 2, 1, 3).flatten(0, 1).unsqueeze(0)
        values = value.permute(0, 2, 1, 3).flatten(0, 1).unsqueeze(0)
        self.paged.write(keys, values, slot_mapping, layer_start=layer_idx)

    def window(self, sliding_window: int | None) -> int | None:
        """The layer's sliding window where it can leave a key out (None where every row fits in it)."""
        if sliding_window is None or sliding_window >= self.config.max_seq_len:
            return None
        return sliding_window

    def check_model(self, module, query: torch.Tensor, key: torch.Tensor, sliding_window: int | None) -> None:
        """Refuse a cache built for another model before any token is written or produced."""
        c = self.config
        self._torch_path = not kernel_loader.choose(c.device).use_custom
        model_config = getattr(module, "config", None)
        checks = [("num_layers", c.num_layers, getattr(model_config, "num_hidden_layers", c.num_layers)),
                  ("num_kv_heads", c.num_kv_heads, key.shape[1]),
                  ("head_dim", c.head_dim, key.shape[-1])]
        for field, cache_value, model_value in checks:
            if cache_value != model_value:
                raise ConfigError(f"this cache was built with {field}={cache_value}, but the model has "
                                  f"{field}={model_value}; build it with ponytail.create_cache(model=model, ...)")
        if key.dtype != c.dtype:
            raise ConfigError(f"this cache was built with dtype={c.dtype}, but the model computes K/V in "
                              f"{key.dtype}; build it with ponytail.create_cache(model=model, ...)")
        if key.device != c.device:
            raise ConfigError(f"this cache lives on {c.device}, the model's K/V on {key.device}")

