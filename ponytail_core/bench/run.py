"""`ponytail bench` end to end: load the model, check outputs, time both sides while sampling
memory, then estimate vs measurement. The three steps come in the order of the usual advice
for a KV-cache plug-in: outputs before speed, speed before memory pictures.

With --kv-cache-dtype fp8 the engine runs the same workload twice, K/V in the model's dtype
("ponytail") and then in FP8 ("ponytail fp8"), under the same KV budget, so the two dtypes share
the memory timeline and the tables."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import ConfigError
from ..kv.config import CacheConfig, resolve_device
from ..kv.estimate import estimate_from_config
from ..llm import LLM
from ..models.loader import load_model
from ..utils.dtypes import resolve_dtype, resolve_kv_cache_dtype
from ..utils.units import is_seconds, parse_bytes
from .baseline import run_generate
from .engine_run import EngineSide, idle, pool_snapshot, run_ponytail
from .kv_agreement import KVAgreement, kv_agreement
from .memory import DeviceProbe, MemorySample, MemorySampler
from .output_check import OutputCheck, check_outputs
from .speed import SpeedStats
from .workload import WORKLOADS, Workload, make_workload

BASELINES = ("generate", "none")
AUTO_SIDE = "ponytail"  # the engine with K/V in the model's dtype; its outputs are the ones checked


@dataclass(slots=True)
class BenchConfig:
    """What `ponytail bench` runs; the flag each field comes from is named in its errors."""

    model: str | None = None  # checkpoint directory or .gguf; None: the embedded default model
    requests: int = 16
    prompt_len: int = 128
    output_len: int = 128
    workload: str = "uniform"  # see workload.make_workload
    kv_cache_memory: str | None = None  # Ponytail's KV budget; None: LLM's default
    baseline: str = "generate"  # "none": Ponytail alone
    baseline_batch: int | None = None  # requests per plain generate call; None: all at once
    out: Path = Path("ponytail-bench")
    device: str = "auto"
    dtype: str | None = None  # None: float32 on the CPU, bfloat16 on CUDA (load_model's default)
    check_requests: int = 4  # requests in the output check's sample
    check_tokens: int = 16  # greedy tokens each; 0 skips the check
    max_num_seqs: int = 256
    kv_release_after: float = 30.0  # the engine's kv_release_after_s
    idle: float = 0.0  # seconds the pool is watched after the last request
    sample_interval: float = 0.05  # seconds between memory samples
    seed: int = 0
    kv_cache_dtype: str = "auto"  # fp8 / fp8_e4m3: a second Ponytail side storing K/V in FP8
    calculate_kv_scales: bool | None = None  # the FP8 side's; None: on (the embedded model has no scales)

    def __post_init__(self):
        if self.workload not in WORKLOADS:
            raise ConfigError(f"--workload {self.workload!r} is not supported; allowed: {', '.join(WORKLOADS)}")
        if self.baseline not in BASELINES:
            raise ConfigError(f"--baseline {self.baseline!r} is not supported; allowed: {', '.join(BASELINES)}")
        for flag, value, low in (("--requests", self.requests, 1), ("--prompt-len", self.prompt_len, 1),
                                 ("--output-len", self.output_len, 1), ("--check-requests", self.check_requests, 1),
                                 ("--check-tokens", self.check_tokens, 0), ("--max-num-seqs", self.max_num_seqs, 1),
                                 ("--baseline-batch", 1 if self.baseline_batch is None else self.baseline_batch, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{flag} {value!r} is invalid; allowed: an integer >= {low}")
        for flag, value in (("--kv-release-after", self.kv_release_after), ("--idle", self.idle)):
            if not is_seconds(value):
                raise ConfigError(f"{flag} {value!r} is invalid; allowed: seconds >= 0")
        if not is_seconds(self.sample_interval) or self.sample_interval <= 0:
            raise ConfigError(f"--sample-interval {self.sample_interval!r} is invalid; allowed: seconds > 0")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory, "--kv-cache-memory")
        self.kv_cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, "--kv-cache-dtype")
        if self.calculate_kv_scales is not None and not isinstance(self.calculate_kv_scales, bool):
            raise ConfigError(f"--calculate-kv-scales {self.calculate_kv_scales!r} is invalid; allowed: True, "
                              "False or None (on with FP8)")
        if self.kv_cache_dtype == "auto" and self.calculate_kv_scales is not None:
            # Scales exist only for FP8: the flag would silently do nothing.
            raise ConfigError("--calculate-kv-scales/--no-calculate-kv-scales applies to an FP8 KV cache; "
                              "allowed: with --kv-cache-dtype fp8 or fp8_e4m3")
        if self.calculate_kv_scales is None:
            # Without checkpoint scales FP8 would use 1.0 and round small K/V to zero; a checkpoint that
            # has scales keeps them anyway (models/kv_scales.py reads those first).
            self.calculate_kv_scales = self.kv_cache_dtype != "auto"
        self.out = Path(self.out)

    def engine_sides(self) -> list[tuple[str, str]]:
        """(side, kv_cache_dtype) of each Ponytail run, in the order they run."""
        sides = [(AUTO_SIDE, "auto")]
        if self.kv_cache_dtype != "auto":
            sides.append((f"{AUTO_SIDE} {self.kv_cache_dtype}", self.kv_cache_dtype))
        return sides

    def engine_kwargs(self, kv_cache_dtype: str) -> dict:
        """LLM() arguments that differ between the Ponytail sides."""
        if kv_cache_dtype == "auto":
            return {}
        return {"kv_cache_dtype": kv_cache_dtype, "calculate_kv_scales": self.calculate_kv_scales}


@dataclass(slots=True)
class BenchResult:
    config: BenchConfig
    device: str  # e.g. "NVIDIA H200" or "cpu"
    dtype: str
    memory_source: str  # where device memory came from (NVML, torch allocator, process RSS)
    weights_bytes: int
    workload: Workload
    check: OutputCheck
    speeds: dict[str, SpeedStats] = field(default_factory=dict)  # side -> speed
    notes: dict[str, str] = field(default_factory=dict)  # side -> why it has no numbers
    samples: list[MemorySample] = field(default_factory=list)
    engines: dict[str, EngineSide] = field(default_factory=dict)  # Ponytail side -> its KV pool and peaks
    agreement: KVAgreement | None = None  # the FP8 side's greedy tokens against the auto side's
    interrupted: bool = False


@dataclass(slots=True)
class Progress:
    """Callbacks into whatever shows progress (rich in the command, nothing in tests)."""

    phase: Callable[[str, int], None] = lambda name, total: None  # a phase starts: name, requests
    advance: Callable[[int], None] = lambda n: None  # n more requests finished


def run_bench(config: BenchConfig, progress: Progress | None = None) -> BenchResult:
    progress = progress or Progress()
    _check_fp8_dtype(config)
    model, tokenizer = load_model(config.model, device=config.device, dtype=config.dtype)
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    workload = make_workload(config.workload, config.requests, config.prompt_len, config.output_len, vocab,
                             seed=config.seed)
    llm_kwargs = dict(tokenizer=tokenizer, kv_cache_memory=config.kv_cache_memory,
                      max_num_seqs=config.max_num_seqs, kv_release_after_s=config.kv_release_after)
    sample = workload.prompts[:config.check_requests]
    check_len = max(len(p) for p in sample) + config.check_tokens
    progress.phase("output check", len(sample))

    def generate(prompts, params):  # the engine goes when this returns (see check_outputs)
        return LLM(model, max_model_len=check_len, **llm_kwargs).generate(prompts, params)

    check = check_outputs(model, sample, config.check_tokens, generate)
    progress.advance(len(sample))
    probe = DeviceProbe(device)
    result = BenchResult(config=config, device=_device_name(device), dtype=str(check.dtype),
                         memory_source=probe.source, workload=workload, check=check,
                         weights_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
    if not check.passed:
        return result  # no speed is quoted for wrong outputs
    if check.checked and len(config.engine_sides()) > 1:
        side, kv_cache_dtype = config.engine_sides()[1]
        progress.phase(f"{kv_cache_dtype} check", len(sample))

        def generate_fp8(prompts, params):
            llm = LLM(model, max_model_len=check_len, **llm_kwargs, **config.engine_kwargs(kv_cache_dtype))
            return llm.generate(prompts, params)

        result.agreement = kv_agreement(side, kv_cache_dtype, sample, check.ponytail.tokens, generate_fp8)
        progress.advance(len(sample))
    sampler = MemorySampler(probe, config.sample_interval)
    try:
        if config.baseline == "generate":
            _run_baseline(model, tokenizer, workload, config, sampler, progress, result)
        for side, kv_cache_dtype in config.engine_sides():
            if result.interrupted:
                break
            _run_engine(model, workload, llm_kwargs, config, sampler, progress, result, side, kv_cache_dtype)
    except KeyboardInterrupt:  # between the sides' own loops (which stop cleanly themselves)
        result.interrupted = True
    finally:
        probe.close()
        result.samples = sampler.samples
    return result


def _run_baseline(model, tokenizer, workload, config, sampler, progress, result) -> None:
    device = next(model.parameters()).device
    _fresh_memory(device)
    model.set_attn_implementation("sdpa")  # as users run it (an engine may have switched it)
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    progress.phase("plain generate", len(workload.prompts))
    sampler.start("generate")
    try:
        speed = run_generate(model, workload, config.baseline_batch or len(workload.prompts),
                             0 if pad is None else pad, progress.advance)
        result.speeds["generate"] = speed
        result.interrupted = speed.interrupted
    except torch.OutOfMemoryError as exc:  # what a static cache hits first: say so, go on to Ponytail
        result.notes["generate"] = f"out of device memory: {str(exc).splitlines()[0]}"
    finally:
        sampler.stop()
    _fresh_memory(device)


def _run_engine(model, workload, llm_kwargs, config, sampler, progress, result, side, kv_cache_dtype) -> None:
    llm = LLM(model, max_model_len=workload.max_seq_len, **llm_kwargs, **config.engine_kwargs(kv_cache_dtype))
    cache_config = llm.engine.cache.config
    engine = result.engines[side] = EngineSide.of(llm)
    engine.estimate = estimate_from_config(
        CacheConfig.from_model(model, max_batch_size=min(len(workload.prompts), config.max_num_seqs),
                               max_seq_len=workload.max_seq_len, block_size=cache_config.block_size,
                               device=cache_config.device, kv_cache_dtype=cache_config.kv_cache_dtype),
        gpu_memory=cache_config.memory_budget)
    progress.phase(side, len(workload.prompts))
    sampler.start(side, pool_snapshot(llm))  # the pool as built, before the first step
    try:
        speed, engine.peak_running = run_ponytail(llm, workload, sampler, progress.advance, side)
        result.speeds[side] = speed
        result.interrupted = speed.interrupted
        if not speed.interrupted and config.idle > 0:
            progress.phase(f"idle {config.idle:g} s", 0)
            result.interrupted = idle(llm, sampler, config.idle)
    finally:
        sampler.stop()
        engine.pool_peak_bytes = llm.engine.cache.peak_allocated_bytes
        del llm
        _fresh_memory(next(model.parameters()).device)


def _check_fp8_dtype(config: BenchConfig) -> None:
    """FP8 on CUDA needs a 16-bit model (its kernels dequantize into bf16/fp16): say so before the
    model loads rather than after the auto side's check has run."""
    if config.kv_cache_dtype == "auto" or config.dtype is None:
        return
    device = resolve_device(None if config.device == "auto" else config.device, "--device")
    if device.type == "cuda" and resolve_dtype(config.dtype, "--dtype") == torch.float32:
        raise ConfigError(f"--kv-cache-dtype {config.kv_cache_dtype} with --dtype float32 on {device}: the FP8 "
                          "kernels dequantize into bfloat16 or float16; allowed: --dtype bfloat16 or float16, "
                          "or --kv-cache-dtype auto")


def _fresh_memory(device: torch.device) -> None:
    gc.collect()  # the previous side's cache goes before the next side is measured
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        time.sleep(0.2)  # NVML's view settles


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
