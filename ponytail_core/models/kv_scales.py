"""An FP8 pool's scales from the model: its checkpoint's k_scale / v_scale, a calculation, or 1.0.

Quantization tools write one K and one V scale per attention layer into the checkpoint:
llm-compressor and vLLM as `model.layers.N.self_attn.k_scale` / `.v_scale`, AutoFP8 as
`...self_attn.k_proj.output_scale` / `...v_proj.output_scale`. transformers drops them at load
(no module has such a parameter), so they are read from the checkpoint's safetensors files
directly, tensor by tensor; a model whose modules do carry them (compressed-tensors) gives them
first. The order and the reasons: docs/fp8.md.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..kv.scales import KVScales

logger = logging.getLogger("ponytail.kv")

_SCALE_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(k_scale|v_scale|k_proj\.output_scale|v_proj\.output_scale)$")


def set_kv_scales(scales: KVScales, model: Any, calculate: bool = False) -> str:
    """Give an FP8 pool its scales: the checkpoint's, else calculated from the first prompt (when
    `calculate`), else 1.0 with a warning. Returns where they came from (KVScales.source)."""
    found = scales_in_modules(model, scales.num_layers) or scales_in_checkpoint(model, scales.num_layers)
    if found is not None:
        scales.set(*found)
        logger.info("FP8 KV cache: per-layer K/V scales from the checkpoint")
    elif calculate:
        scales.calculate_on_first_write()
        logger.info("FP8 KV cache: K/V scales will be calculated from the first prompt (calculate_kv_scales)")
    else:
        logger.warning("FP8 KV cache: the checkpoint has no k_scale/v_scale, so every scale is 1.0; K/V "
                       "values below about 0.002 lose precision. calculate_kv_scales=True takes them from "
                       "the first prompt instead (docs/fp8.md)")
    return scales.source


def scales_in_modules(model: Any, num_layers: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Scales a model's attention modules carry as attributes (k_scale, v_scale), if every layer has them."""
    if not hasattr(model, "named_modules"):
        return None
    found: dict[str, dict[int, torch.Tensor]] = {"k": {}, "v": {}}
    for name, module in model.named_modules():
        match = re.search(r"(?:^|\.)layers\.(\d+)\.self_attn$", name)
        if match is None:
            continue
        for kind in ("k", "v"):
            value = getattr(module, f"{kind}_scale", None)
            if isinstance(value, torch.Tensor):
                found[kind][int(match.group(1))] = value
    return _complete(found, num_layers, "the model's attention modules")


def scales_in_checkpoint(model: Any, num_layers: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Scales in the safetensors files the model was loaded from, if every layer has them."""
    files = _checkpoint_files(model)
    if not files:
        return None
    from safetensors import safe_open

    found: dict[str, dict[int, torch.Tensor]] = {"k": {}, "v": {}}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                match = _SCALE_KEY.search(key)
                if match is not None:
                    found[match.group(2)[0]][int(match.group(1))] = _scalar(key, f.get_tensor(key))
    return _complete(found, num_layers, f"the checkpoint ({files[0].parent})")


def _scalar(key: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() != 1:
        raise ConfigError(f"{key} has shape {tuple(tensor.shape)}; allowed: one scale per layer for K and for V "
                          "(shape () or (1,)); per-head KV scales are not supported")
    return tensor.reshape(()).float()


def _complete(found: dict[str, dict[int, torch.Tensor]], num_layers: int, where: str):
    if not found["k"] and not found["v"]:
        return None
    missing = [f"{kind}_scale of layer {i}" for kind in ("k", "v") for i in range(num_layers) if i not in found[kind]]
    if missing:
        raise ConfigError(f"{where} has K/V scales for some layers but not {', '.join(missing[:4])}"
                          f"{' and more' if len(missing) > 4 else ''}; allowed: a k_scale and a v_scale for "
                          f"each of the {num_layers} layers, or none (docs/fp8.md)")
    return tuple(torch.stack([found[kind][i].reshape(()).float().cpu() for i in range(num_layers)])
                 for kind in ("k", "v"))


def _checkpoint_files(model: Any) -> list[Path]:
    """The *.safetensors files of a model loaded from a local directory or the hub's cache."""
    source = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not source:
        return []
    folder = Path(source)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(source, local_files_only=True, allow_patterns=["*.safetensors"]))
        except Exception:  # not a hub id, or not in the cache: no checkpoint to read scales from
            return []
    return sorted(folder.glob("*.safetensors"))
