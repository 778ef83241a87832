"""`ponytail bench` end to end: load the model, check outputs, time both sides while sampling
memory, then estimate vs measurement. The three steps come in the order of the usual advice
for a KV-cache plug-in: outputs before speed, speed before memory pictures."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import ConfigError
from ..kv.config import CacheConfig
from ..kv.estimate import KVEstimate, estimate_from_config
from ..llm import LLM
from ..models.loader import load_model
from ..utils.units import is_seconds, parse_bytes
from .baseline import run_generate
from .engine_run import idle, pool_snapshot, run_ponytail
from .memory import DeviceProbe, MemorySample, MemorySampler
from .output_check import OutputCheck, check_outputs
from .speed import SpeedStats
from .workload import WORKLOADS, Workload, make_workload

BASELINES = ("generate", "none")


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
        self.out = Path(self.out)


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
    kv_budget_bytes: int | None = None  # Ponytail's KV budget
    kv_pool_peak_bytes: int | None = None
    peak_running: int | None = None  # most Ponytail requests running at once
    estimate: KVEstimate | None = None
    interrupted: bool = False


@dataclass(slots=True)
class Progress:
    """Callbacks into whatever shows progress (rich in the command, nothing in tests)."""

    phase: Callable[[str, int], None] = lambda name, total: None  # a phase starts: name, requests
    advance: Callable[[int], None] = lambda n: None  # n more requests finished


def run_bench(config: BenchConfig, progress: Progress | None = None) -> BenchResult:
    progress = progress or Progress()
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
    sampler = MemorySampler(probe, config.sample_interval)
    try:
        if config.baseline == "generate":
            _run_baseline(model, tokenizer, workload, config, sampler, progress, result)
        if not result.interrupted:
            _run_engine(model, workload, llm_kwargs, config, sampler, progress, result)
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


def _run_engine(model, workload, llm_kwargs, config, sampler, progress, result) -> None:
    llm = LLM(model, max_model_len=workload.max_seq_len, **llm_kwargs)
    cache_config = llm.engine.cache.config
    result.kv_budget_bytes = cache_config.memory_budget
    result.estimate = estimate_from_config(
        CacheConfig.from_model(model, max_batch_size=min(len(workload.prompts), config.max_num_seqs),
                               max_seq_len=workload.max_seq_len, block_size=cache_config.block_size, device=cache_config.device),
        gpu_memory=cache_config.memory_budget)
    progress.phase("ponytail", len(workload.prompts))
    sampler.start("ponytail", pool_snapshot(llm))  # the pool as built, before the first step
    try:
        speed, result.peak_running = run_ponytail(llm, workload, sampler, progress.advance)
        result.speeds["ponytail"] = speed
        result.interrupted = speed.interrupted
        if not speed.interrupted and config.idle > 0:
            progress.phase(f"idle {config.idle:g} s", 0)
            result.interrupted = idle(llm, sampler, config.idle)
    finally:
        sampler.stop()
        result.kv_pool_peak_bytes = llm.engine.cache.peak_allocated_bytes
        del llm
        _fresh_memory(next(model.parameters()).device)


def _fresh_memory(device: torch.device) -> None:
    gc.collect()  # the previous side's cache goes before the next side is measured
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        time.sleep(0.2)  # NVML's view settles


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
