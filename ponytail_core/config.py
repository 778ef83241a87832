"""The engine's configuration: one typed source for `LLM()`, the serving app and `ponytail serve`.

`EngineConfig` nests one dataclass per job (model, cache, scheduler, runner, parallel, tuning).
Each field is documented once, by the docstring under it (`field_docs` reads them for the CLI's
help and docs/configuration.md), and checked once, in its dataclass's `__post_init__`, by a
ConfigError that names the field, the value and what is allowed. `LLM(model, **kwargs)` takes the
fields by name, flat, as vLLM's `LLM` does (`EngineConfig.from_kwargs` puts each where it
belongs); `resolved` fills every default that depends on the device or the model, in one place.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
from dataclasses import dataclass, field
from typing import Any

from .attention.fa4 import PREFILL_ATTENTION
from .errors import ConfigError
from .kv.config import DEFAULT_BLOCK_SIZE
from .utils.dtypes import resolve_kv_cache_dtype
from .utils.units import is_seconds, parse_bytes

POLICIES = ("fcfs", "priority")  # vLLM's scheduling policies
# A CPU step's time grows with its tokens (and, context_aware_chunks, their context): a long prompt in
# chunks of this budget keeps the streams beside it within 2x of their usual pause (docs/engine.md).
CPU_BATCHED_TOKENS = 128
# On a GPU a prefill step's time barely grows below a few thousand tokens (the weights are read once
# per step either way): vLLM's online default for this class of device.
GPU_BATCHED_TOKENS = 8192
GPU_PREFILL_ONLY_BATCHED_TOKENS = 16384  # steps without decode rows on a GPU: vLLM's LLM-class budget
GPU_MAX_NUM_SEQS = 256
CPU_MAX_NUM_SEQS = 64


def default_max_num_seqs(device_type: str) -> int:
    """max_num_seqs when unset: a GPU step costs about the same for 64 or 256 decode rows, a CPU step's
    time grows with its rows."""
    return GPU_MAX_NUM_SEQS if device_type == "cuda" else CPU_MAX_NUM_SEQS


def _flag(config: Any, name: str) -> None:
    value = getattr(config, name)
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not supported; allowed: True, False or None (the device's default)")


def _strict_bool(config: Any, name: str) -> None:
    value = getattr(config, name)
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not supported; allowed: True or False")


def _count(config: Any, name: str, optional: bool = True) -> None:
    value = getattr(config, name)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "an integer >= 1" + (", or None (the default)" if optional else "")
        raise ConfigError(f"{name}={value!r} is not supported; allowed: {allowed}")


@dataclass(slots=True)
class ModelConfig:
    """How the model is loaded and how long its sequences may be."""

    device: str = "auto"
    """auto (a GPU where there is one, else the CPU), cuda, cuda:N or cpu"""
    dtype: str | None = None
    """the weights' and KV cache's dtype (bfloat16, float16, float32); None: bfloat16 on CUDA, float32 on the CPU"""
    max_model_len: int | None = None
    """longest prompt + output in tokens; None: the model's max_position_embeddings"""
    revision: str | None = None
    """a hub id's branch, tag or commit, for the weights, tokenizer and generation_config.json; None: main"""
    trust_remote_code: bool = False
    """run the model and tokenizer code a checkpoint ships (transformers' flag, as vLLM's)"""
    seed: int | None = None
    """seeds torch's generators, which requests without a seed of their own draw from; None: not seeded"""

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not (self.device in ("auto", "cpu", "cuda")
                                                    or self.device.startswith("cuda:")):
            raise ConfigError(f"device={self.device!r} is not supported; allowed: auto, cuda, cuda:N, cpu")
        if self.dtype is not None and not isinstance(self.dtype, str):
            self.dtype = str(self.dtype).removeprefix("torch.")  # a torch.dtype, by name
        _count(self, "max_model_len")
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision):
            raise ConfigError(f"revision={self.revision!r} is not supported; allowed: a branch, tag or commit, or None")
        _strict_bool(self, "trust_remote_code")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ConfigError(f"seed={self.seed!r} is not supported; allowed: an int >= 0, or None")


@dataclass(slots=True)
class KVCacheConfig:
    """How large the KV pool may grow and what it keeps (the pool's shape, `CacheConfig`, comes from
    this and the model)."""

    kv_cache_memory: int | str | None = None
    """the most the KV pool grows to, bytes or "4GiB"; None: on CUDA 90% of the device less the weights
    (vLLM's default gpu_memory_utilization), 2 GiB on the CPU; a ceiling, never reserved up front"""
    gpu_memory_utilization: float | None = None
    """instead of kv_cache_memory: the share of the GPU's total memory this engine may hold (weights + KV)"""
    block_size: int = DEFAULT_BLOCK_SIZE
    """tokens per KV block"""
    enable_prefix_caching: bool = True
    """full blocks of finished prompts stay cached, and prompts that start the same way reuse them"""
    keep_prefix_cache: bool = False
    """while requests run, grow the pool within its budget rather than evict cached prefixes (a chat's
    next turn finds its history); they go back with the spare memory after kv_release_after_s idle"""
    kv_release_after_s: float = 30.0
    """seconds the pool's spare memory is kept before it goes back to the device (0: at once)"""
    kv_cache_dtype: str = "auto"
    """how K/V are stored: auto (the model's dtype), fp8 or fp8_e4m3 (one byte an element, with a scale per
    layer for K and for V: twice the tokens in the same memory; docs/fp8.md)"""
    calculate_kv_scales: bool = False
    """with FP8 and a checkpoint without k_scale/v_scale: take each layer's scales from the first prompt's K/V
    (vLLM's rule: amax / 200 for K, amax / 100 for V) instead of 1.0"""

    def __post_init__(self) -> None:
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        share = self.gpu_memory_utilization
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0 < share <= 1):
            raise ConfigError(f"gpu_memory_utilization={share!r} is not supported; allowed: a share of the "
                              "device's total memory in (0, 1], e.g. 0.9 (or None: kv_cache_memory decides)")
        if share is not None and self.kv_cache_memory is not None:
            raise ConfigError(f"kv_cache_memory={self.kv_cache_memory!r} and gpu_memory_utilization={share!r} were "
                              "both given; allowed: one of them")
        _count(self, "block_size", optional=False)
        _strict_bool(self, "enable_prefix_caching")
        _strict_bool(self, "keep_prefix_cache")
        self.kv_cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype)
        _strict_bool(self, "calculate_kv_scales")
        if not is_seconds(self.kv_release_after_s):
            raise ConfigError(f"kv_release_after_s={self.kv_release_after_s!r} is not supported; allowed: seconds "
                              ">= 0 (0: give spare KV memory back at once)")


@dataclass(slots=True)
class SchedulerConfig:
    """What one engine step holds and in which order requests run."""

    max_num_seqs: int | None = None
    """sequences that run at once; None: 256 on a GPU, 64 on the CPU"""
    max_num_batched_tokens: int | None = None
    """tokens one step holds while some sequence decodes; None: 8,192 on a GPU, 128 on the CPU"""
    scheduling_policy: str = "fcfs"
    """fcfs (first come, first served) or priority (a request's priority orders the queue, lower first,
    and preemption takes the least urgent; vLLM's)"""

    def __post_init__(self) -> None:
        _count(self, "max_num_seqs")
        _count(self, "max_num_batched_tokens")
        if self.scheduling_policy not in POLICIES:
            raise ConfigError(f"scheduling_policy={self.scheduling_policy!r} is not supported; allowed: "
                              f"{', '.join(POLICIES)}")


@dataclass(slots=True)
class RunnerConfig:
    """How each step's forward pass runs on the device."""

    enforce_eager: bool = False
    """run the model eagerly: no CUDA graphs, no torch.compile (vLLM's; debugging, or a model that will not compile)"""
    cuda_graphs: bool | None = None
    """replay decode-only steps from captured CUDA graphs; None: on for CUDA"""
    compile_model: bool | None = None
    """torch.compile the decoder layers around the attention call (the first start compiles, later ones hit
    inductor's disk cache); None: on for CUDA when LLM loads the model itself"""
    async_scheduling: bool | None = None
    """launch each step before the previous one's tokens reach the host (same outputs); None: on for CUDA"""
    prefill_attention: str | None = None
    """the kernel prompt chunks attend through on CUDA: flash (torch's FlashAttention-2) or fa4
    (FlashAttention-4, pip install 'ponytail[fa4]'); None: fa4 where installed on Hopper or Blackwell with
    head_dim >= 128, else flash"""

    def __post_init__(self) -> None:
        _strict_bool(self, "enforce_eager")
        for name in ("cuda_graphs", "compile_model", "async_scheduling"):
            _flag(self, name)
        if self.enforce_eager and (self.cuda_graphs or self.compile_model):
            raise ConfigError(f"enforce_eager=True runs the model eagerly, but cuda_graphs={self.cuda_graphs!r} and "
                              f"compile_model={self.compile_model!r} ask otherwise; allowed: one or the other")
        if self.prefill_attention is not None and self.prefill_attention not in PREFILL_ATTENTION:
            raise ConfigError(f"prefill_attention={self.prefill_attention!r} is not supported; allowed: "
                              f"{', '.join(map(repr, PREFILL_ATTENTION))} or None (fa4 where installed and faster)")


@dataclass(slots=True)
class ParallelConfig:
    """How many devices one engine spans."""

    tensor_parallel_size: int = 1
    """devices one engine's layers are split over: 1 (serve across GPUs with one replica each)"""

    def __post_init__(self) -> None:
        if isinstance(self.tensor_parallel_size, bool) or self.tensor_parallel_size != 1:
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size!r} is not supported; allowed: 1 (an "
                              "engine runs on one device; serve across GPUs with one replica each)")


@dataclass(slots=True)
class TuningConfig:
    """Settings whose defaults are measured (docs/benchmarks.md says on what); users never need them."""

    prefill_only_batched_tokens: int | None = None
    """tokens a step of prompt chunks only may hold; None: 16,384 on CUDA where max_num_batched_tokens is left
    to its default, else max_num_batched_tokens"""
    context_aware_chunks: bool | None = None
    """a prefill chunk's share of the step budget counts its attention over cached context; None: on for the CPU"""
    prefill_delay_factor: float | None = None
    """while requests decode, new prompts wait until the oldest has waited this many times what a prefill
    step costs beyond a decode step's graph replay (at most 0.1 s); None: 1.0 with CUDA graphs, else 0"""
    fuse_projections: bool | None = None
    """one GEMM for q/k/v and one for gate/up per layer (no extra memory); None: on for CUDA when LLM loads
    the model itself"""
    column_major_weights: bool | None = None
    """projection weights stored column-major, their GEMMs through cuBLASLt; None: on for CUDA when LLM loads
    the model itself"""

    def __post_init__(self) -> None:
        _count(self, "prefill_only_batched_tokens")
        for name in ("context_aware_chunks", "fuse_projections", "column_major_weights"):
            _flag(self, name)
        factor = self.prefill_delay_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                   or not math.isfinite(factor) or factor < 0):
            raise ConfigError(f"prefill_delay_factor={factor!r} is not supported; allowed: a number >= 0 (0: prompts "
                              "never wait), or None (1.0 with CUDA graphs)")


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the defaults depend on besides the device, read off the model once it is loaded."""

    loaded_here: bool  # LLM loaded it from a name or path; a model object handed over stays as it is
    compilable: bool  # runner.compile.can_compile: a decoder with a `layers` list
    fusable: bool  # runner.fused_projections.can_fuse
    max_position_embeddings: int


SECTIONS = {"model": ModelConfig, "cache": KVCacheConfig, "scheduler": SchedulerConfig, "runner": RunnerConfig,
            "parallel": ParallelConfig}


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine is built from; `LLM(model, **kwargs)` fills it by field name."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    tuning: TuningConfig = field(default_factory=TuningConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Each keyword to its section (`tuning` takes a dict or a TuningConfig); an unknown name is a
        ConfigError that lists the allowed ones."""
        owners = field_owners()
        unknown = sorted(set(kwargs) - set(owners) - {"tuning"})
        if unknown:
            raise ConfigError(f"unknown engine argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                              f"allowed: {', '.join(sorted(owners))}, tuning")
        parts = {section: {} for section in SECTIONS}
        for name, value in kwargs.items():
            if name != "tuning":
                parts[owners[name]][name] = value
        return cls(**{section: SECTIONS[section](**values) for section, values in parts.items()},
                   tuning=_tuning(kwargs.get("tuning")))

    def resolved(self, device_type: str, facts: ModelFacts) -> EngineConfig:
        """A copy with every None that depends on the device ("cuda", "cpu") or the model filled in.
        prefill_attention stays None here: attention/fa4.py picks it where the kernel's own checks run."""
        cuda = device_type == "cuda"
        model, runner, tuning = self.model, self.runner, self.tuning
        if runner.cuda_graphs and not cuda:
            raise ConfigError(f"cuda_graphs=True needs a CUDA device; the model is on {device_type}")
        eager = runner.enforce_eager
        seqs = self.scheduler.max_num_seqs or default_max_num_seqs(device_type)
        step, prefill_only = token_budgets(device_type, seqs, self.scheduler.max_num_batched_tokens,
                                           tuning.prefill_only_batched_tokens)
        graphs = _default(runner.cuda_graphs, cuda and not eager)
        runner = dataclasses.replace(
            runner, cuda_graphs=graphs,
            compile_model=_default(runner.compile_model, cuda and not eager and facts.loaded_here and facts.compilable),
            async_scheduling=_default(runner.async_scheduling, cuda))
        tuning = TuningConfig(
            prefill_only_batched_tokens=prefill_only,
            context_aware_chunks=_default(tuning.context_aware_chunks, not cuda),
            prefill_delay_factor=float(_default(tuning.prefill_delay_factor, 1.0 if graphs else 0.0)),
            fuse_projections=_default(tuning.fuse_projections, cuda and facts.loaded_here and facts.fusable),
            column_major_weights=_default(tuning.column_major_weights,
                                          cuda and facts.loaded_here and facts.compilable))
        return dataclasses.replace(
            self, runner=runner, tuning=tuning,
            model=dataclasses.replace(model, max_model_len=model.max_model_len or facts.max_position_embeddings),
            scheduler=dataclasses.replace(self.scheduler, max_num_seqs=seqs, max_num_batched_tokens=step))


def token_budgets(device_type: str, max_num_seqs: int, max_num_batched_tokens: int | None = None,
                  prefill_only_batched_tokens: int | None = None) -> tuple[int, int]:
    """(a step's budget with decode rows, a step's of prompt chunks only) on `device_type`. A step with
    decode rows delays every stream's next token, so it stays where a decode row barely notices its
    prompt chunks; a step without them delays nobody, and a larger one packs more prompt tokens into
    each read of the weights. A budget set by hand is a ceiling the user chose: the prompt-only one
    then follows it unless set too."""
    defaulted = max_num_batched_tokens is None
    if defaulted:
        max_num_batched_tokens = max(CPU_BATCHED_TOKENS if device_type == "cpu" else GPU_BATCHED_TOKENS, max_num_seqs)
    if max_num_batched_tokens < max_num_seqs:
        raise ConfigError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_num_seqs="
                          f"{max_num_seqs} so every running sequence can decode each step")
    if prefill_only_batched_tokens is None:
        larger = device_type == "cuda" and defaulted
        prefill_only_batched_tokens = max(GPU_PREFILL_ONLY_BATCHED_TOKENS if larger else 0, max_num_batched_tokens)
    if prefill_only_batched_tokens < max_num_batched_tokens:
        raise ConfigError(f"prefill_only_batched_tokens={prefill_only_batched_tokens} must be >= "
                          f"max_num_batched_tokens={max_num_batched_tokens}: a step without decode rows may "
                          "hold more prompt tokens than one with them, never fewer")
    return max_num_batched_tokens, prefill_only_batched_tokens


def _default(value, default):
    return default if value is None else value


def _tuning(value: Any) -> TuningConfig:
    if value is None:
        return TuningConfig()
    if isinstance(value, TuningConfig):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"tuning={value!r:.60} is not supported; allowed: a dict of "
                          f"{', '.join(f.name for f in dataclasses.fields(TuningConfig))}, or a TuningConfig")
    allowed = {f.name for f in dataclasses.fields(TuningConfig)}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ConfigError(f"unknown tuning argument {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    return TuningConfig(**value)


@functools.cache
def field_owners() -> dict[str, str]:
    """Every flat engine argument (tuning's aside) -> the section that holds it."""
    return {f.name: section for section, kind in SECTIONS.items() for f in dataclasses.fields(kind)}


@functools.cache
def field_docs(kind: type) -> dict[str, str]:
    """A config dataclass's field -> the docstring written under it, on one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(kind)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def engine_fields() -> list[tuple[str, dataclasses.Field, str]]:
    """(section, field, doc) of every engine argument, tuning's included, in the order written."""
    kinds = {**SECTIONS, "tuning": TuningConfig}
    return [(section, f, field_docs(kind).get(f.name, "")) for section, kind in kinds.items()
            for f in dataclasses.fields(kind)]
