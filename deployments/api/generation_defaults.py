"""Sampling defaults a model's generation_config.json recommends, for requests that leave them unset.

vLLM's server does the same unless told otherwise (`--generation-config auto`): a chat model whose
authors ship temperature 0.7 and top_p 0.8 samples that way through the API unless the client sets
them. The app arg `generation_config: ponytail` turns it off (SamplingParams' own defaults), as
`--generation-config vllm` does there.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import GenerationConfig

import ponytail

logger = logging.getLogger(__name__)

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # what vLLM takes from the file too


def model_sampling_defaults(source: str | None, revision: str | None = None) -> dict[str, Any]:
    """The FIELDS the generation_config.json at `source` (a local directory or a cached hub id, at
    `revision` for a hub id: the one the engine loaded) sets; {} without one (a .gguf file, a
    directory without it). A value SamplingParams refuses is left out, with a warning, rather than
    failing every request that leaves the field unset."""
    if source is None:
        return {}
    try:
        config = GenerationConfig.from_pretrained(source, local_files_only=True, revision=revision)
    except (OSError, ValueError):
        return {}
    defaults = {}
    for name in FIELDS:
        value = getattr(config, name, None)
        if value is None:
            continue
        try:
            ponytail.SamplingParams(**{name: value})
        except (ponytail.ConfigError, TypeError, ValueError) as exc:
            logger.warning("generation_config.json of %s: %s=%r is not used as a default (%s)", source, name, value, exc)
            continue
        defaults[name] = value
    return defaults
