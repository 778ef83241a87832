"""The attention a model had before Ponytail's: what it runs on a forward without a Ponytail cache.

`create_cache(model=model)` switches the model to attn_implementation "ponytail", but the model
stays the user's: a plain `model.generate(...)` or `model(...)` without a Ponytail cache must run
exactly as before. `switch_to_ponytail` records each config's previous implementation ("sdpa",
"eager", ...); the "ponytail" mask function then returns a `FallbackMask` that carries both the
padding mask Ponytail's attention reads and, built only when needed, the previous
implementation's own mask; the attention function hands a call without a Ponytail cache to the
previous implementation with that mask.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..errors import ConfigError

# id(config) -> the attn_implementation it had before "ponytail". Keyed by id because configs are
# unhashable (they define __eq__); a weakref.finalize drops the entry with the config.
_PREVIOUS: dict[int, str] = {}


def previous_implementation(config: Any) -> str | None:
    """The implementation `config` had before switch_to_ponytail, or None when none was recorded."""
    return _PREVIOUS.get(id(config))


def _configs(model: Any) -> list[Any]:
    """Every distinct config the model's modules read their attn_implementation from."""
    seen: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())


def switch_to_ponytail(model: Any, name: str, keep_fallback: bool = True) -> None:
    """model.set_attn_implementation(name), remembering each config's previous implementation.

    keep_fallback=False forgets any recorded one instead: the engine owns its model, and its
    forward passes (CUDA graphs, torch.compile) should carry plain masks only."""
    configs = _configs(model)
    before = {id(c): c._attn_implementation for c in configs}
    model.set_attn_implementation(name)
    for config in configs:
        key = id(config)
        if not keep_fallback:
            _PREVIOUS.pop(key, None)
        elif before[key] not in (None, name) and key not in _PREVIOUS:
            _PREVIOUS[key] = before[key]
            weakref.finalize(config, _PREVIOUS.pop, key, None)


@dataclass(slots=True, eq=False)
class FallbackMask:
    """What the "ponytail" mask function returns for a model with a previous implementation.

    Every layer of one forward gets the same object, so the previous implementation's mask is
    built at most once per forward, and never on forwards that do use a Ponytail cache."""

    padding: torch.Tensor | None  # the 2-D padding mask (or None) Ponytail's attention reads
    build: Callable[[], Any]  # the previous implementation's mask function, arguments bound
    _built: list = field(default_factory=list)

    def previous(self) -> Any:
        if not self._built:
            self._built.append(self.build())
        return self._built[0]


def wrap_mask(padding_mask_fn: Callable[..., Any]) -> Callable[..., Any]:
    """The "ponytail" mask function: padding_mask_fn's result, plus the previous mask on demand."""

    def mask(*args, config: Any = None, **kwargs):
        padding = padding_mask_fn(*args, config=config, **kwargs)
        previous = previous_implementation(config) if config is not None else None
        if previous is None or previous not in ALL_MASK_ATTENTION_FUNCTIONS:
            return padding
        previous_fn = ALL_MASK_ATTENTION_FUNCTIONS[previous]
        return FallbackMask(padding, lambda: previous_fn(*args, config=config, **kwargs))

    return mask


def padding_mask(attention_mask: Any) -> Any:
    """What Ponytail's attention reads from whatever the mask function returned."""
    return attention_mask.padding if isinstance(attention_mask, FallbackMask) else attention_mask


def run_previous(module: torch.nn.Module, query, key, value, attention_mask, **kwargs):
    """The call Ponytail's attention got without a Ponytail cache, run by the previous implementation."""
    config = getattr(module, "config", None)
    previous = previous_implementation(config) if config is not None else None
    if previous is None:
        raise ConfigError(
            "attn_implementation='ponytail' needs a Ponytail cache: pass "
            "cache=ponytail.create_cache(model=model, ...) to generate/forward (this model's "
            "previous attention implementation was not recorded, so there is nothing to fall back to)")
    if isinstance(attention_mask, FallbackMask):
        attention_mask = attention_mask.previous()
    return _attention_function(module, previous)(module, query, key, value, attention_mask, **kwargs)


def _attention_function(module: torch.nn.Module, name: str) -> Callable[..., Any]:
    if name != "eager" and name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    # "eager" is not in the registry: each modeling file defines its own eager_attention_forward.
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if name == "eager" and eager is not None:
        return eager
    raise ConfigError(f"attn_implementation={name!r} (the model's implementation before 'ponytail') "
                      f"cannot be called for {type(module).__name__}; allowed: 'eager' or one of "
                      f"{sorted(ALL_ATTENTION_FUNCTIONS)}")
