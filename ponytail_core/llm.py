"""`ponytail.LLM`: offline batched generation with the vLLM-style API users already know."""

from __future__ import annotations

import dataclasses
import math
import logging
from functools import partial
from typing import Any

import torch

from .kv.config import DEFAULT_BLOCK_SIZE, CacheConfig, growth_chunk_blocks
from .errors import ConfigError
from .models.chat_template import check_chat_template_options, render_chat
from .engine.llm_engine import LLMEngine
from .engine.scheduler import check_policy
from .engine.chunk_cost import context_cost
from .engine.token_budget import token_budgets
from .engine.stats import EngineStats
from .models.loader import load_model, load_tokenizer
from .runner.compile import can_compile
from .runner.fused_projections import can_fuse
from .engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from .engine.request import RequestOutput, unpack_prompt
from .attention.fa4 import choose_prefill_attention
from .kv.budget import kv_budget, step_headroom
from .kv.paged_cache import PagedKVCache
from .kv.prefix_events import PrefixEventLog
from .sampling.params import SamplingParams
from .utils.units import format_bytes, is_seconds
from .utils.arith import cdiv

logger = logging.getLogger("ponytail.engine")

POOL_CHUNKS = 64  # the pool grows and shrinks in steps of about 1/64 of its budget


class LLM:
    """A model, a paged KV cache and a continuous-batching engine.

    llm = ponytail.LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], ponytail.SamplingParams(max_tokens=32))

    async_scheduling: launch each step before the previous one's tokens are read back, so the
    device never waits for the host (same outputs); None: on for CUDA devices, off on the CPU.
    compile_model: torch.compile the decoder layers (inductor fuses the norms, rotary and SiLU
    between the GEMMs); None: on for CUDA devices when LLM loads the model itself (a name or path)
    and it has a `layers` list; a model object handed over stays eager unless True (compiling
    changes its layers in place). Inductor caches its kernels on disk (TORCHINDUCTOR_CACHE_DIR),
    so later starts skip most of the compile.
    max_num_batched_tokens: the tokens a step holds while some sequence decodes (None: 8,192 on CUDA, 128 on
    the CPU); prefill_only_batched_tokens: a step of prompt chunks only, which delays no stream's next token
    (None: 16,384 on CUDA where max_num_batched_tokens is left to its default, else the same;
    engine/token_budget.py).
    context_aware_chunks: a prefill chunk's share of max_num_batched_tokens counts its attention
    over cached context too (engine/chunk_cost.py), so the last chunks of a long prompt are
    smaller and no step beside running streams is much slower than the first; None: on for the
    CPU, where attention over a long context is a large part of a step (docs/engine.md).
    keep_prefix_cache: while requests run, the KV pool grows within its budget rather than evict
    cached prompt prefixes (a chat's next turn, a document asked about again finds them); they go
    back with the rest of the spare memory after kv_release_after_s without requests. Off (the
    default offline): the pool holds what running requests need and caches prefixes in what is left.
    prefill_delay_factor: while requests decode, new prompts wait until the oldest has waited this
    many times what a step with a prompt costs beyond a decode step's graph replay (measured at
    start-up, runner/step_overhead.py; without graphs, the last prefill step's duration; at most
    0.1 s), so prompts arriving close together share one step without CUDA graphs and the decode
    steps between replay them (engine/scheduler.py); None: 1.0 where CUDA graphs are on, 0 (no
    wait) elsewhere.
    fuse_projections: one GEMM for q/k/v and one for gate/up in every decoder layer (their weights
    become views of one concatenated weight: no extra memory; runner/fused_projections.py); None:
    on for CUDA devices when LLM loads the model itself and its layers have such projections (2-3%
    more output tokens/s on a 7B, H200); a model object handed over stays as it is unless True.
    column_major_weights: the decoder's projection weights (and an untied LM head's) stored
    column-major, their GEMMs run through cuBLASLt (runner/gemm_layout.py: 7% faster GEMMs at 64
    rows on a 7B, H200; 1.9% more output tokens/s on 64 x 512/1,024); None: on for CUDA devices
    when LLM loads the model itself.
    prefill_attention: the kernel that attends packed prompt chunks on CUDA: "flash" (torch's
    FlashAttention-2) or "fa4" (FlashAttention-4, `pip install 'ponytail[fa4]'`: attention 1.14-1.26x
    as fast at head_dim 128, a 7B's prefill 1.05x, H200; attention/fa4.py); None: "fa4" where it is
    installed, the GPU is Hopper or Blackwell and head_dim >= 128, else "flash".
    vLLM's own arguments, for scripts written for it: tokenizer (an object, or a name or path to
    load), enforce_eager (no CUDA graphs, no compile), seed (torch's generators, which requests
    without a seed of their own draw from), revision and trust_remote_code (passed to
    transformers), tensor_parallel_size (1 only: one engine per device, replicas across devices),
    scheduling_policy ("fcfs", or "priority": generate's priority orders the queue, lower first, and
    preemption takes the least urgent; engine/scheduler.py).
    """

    def __init__(self, model: Any = None, *, tokenizer: Any = None, device: str = "auto", dtype: Any = None,
                 kv_cache_memory: int | str | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 max_num_seqs: int = 256, max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 prefill_only_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 cuda_graphs: bool | None = None,
                 compile_model: bool | None = None, async_scheduling: bool | None = None,
                 kv_release_after_s: float = 30.0, gpu_memory_utilization: float | None = None,
                 context_aware_chunks: bool | None = None, keep_prefix_cache: bool = False,
                 prefill_delay_factor: float | None = None, fuse_projections: bool | None = None,
                 prefill_attention: str | None = None, column_major_weights: bool | None = None,
                 enforce_eager: bool = False, seed: int | None = None, tensor_parallel_size: int = 1,
                 revision: str | None = None, trust_remote_code: bool = False, scheduling_policy: str = "fcfs"):
        loaded_here = model is None or isinstance(model, str)
        check_policy(scheduling_policy)  # before seconds of loading
        cuda_graphs, compile_model = _vllm_options(loaded_here, cuda_graphs, compile_model, enforce_eager, seed,
                                                   tensor_parallel_size, revision, trust_remote_code)
        if loaded_here:
            model, tokenizer_loaded = load_model(model, device=device, dtype=dtype, revision=revision,
                                                 trust_remote_code=trust_remote_code)
            tokenizer = tokenizer_loaded if tokenizer is None else tokenizer
        if isinstance(tokenizer, str):  # vLLM's tokenizer=<name or path>
            tokenizer = load_tokenizer(tokenizer)
        # A model object without a tokenizer runs on token ids alone (like vLLM's skip_tokenizer_init).
        device = next(model.parameters()).device
        text_config = model.config.get_text_config()
        if max_model_len is None:
            max_model_len = int(getattr(text_config, "max_position_embeddings", 2048))
        budgets = token_budgets(device.type, max_num_seqs, max_num_batched_tokens, prefill_only_batched_tokens)
        if cuda_graphs is None:
            cuda_graphs = device.type == "cuda"
        elif cuda_graphs and device.type != "cuda":
            raise ConfigError(f"cuda_graphs=True needs a CUDA device; the model is on {device}")
        if compile_model is None:  # a model object stays as handed over: compiling changes it in place
            compile_model = device.type == "cuda" and loaded_here and can_compile(model)
        elif not isinstance(compile_model, bool):
            raise ConfigError(f"compile_model={compile_model!r} must be True, False or None "
                              "(None: on for CUDA devices where the model supports it)")
        if async_scheduling is None:
            async_scheduling = device.type == "cuda"  # on the CPU the forward pass runs at launch: nothing to overlap
        elif not isinstance(async_scheduling, bool):
            raise ConfigError(f"async_scheduling={async_scheduling!r} must be True, False or None "
                              "(None: on for CUDA devices, off on the CPU)")
        if context_aware_chunks is None:
            context_aware_chunks = device.type == "cpu"
        elif not isinstance(context_aware_chunks, bool):
            raise ConfigError(f"context_aware_chunks={context_aware_chunks!r} must be True, False or None "
                              "(None: on for the CPU, off on CUDA devices)")
        if prefill_delay_factor is None:
            prefill_delay_factor = 1.0 if cuda_graphs else 0.0  # without graphs every step costs alike
        elif isinstance(prefill_delay_factor, bool) or not (isinstance(prefill_delay_factor, (int, float))
                                                            and math.isfinite(prefill_delay_factor)
                                                            and prefill_delay_factor >= 0):
            raise ConfigError(f"prefill_delay_factor={prefill_delay_factor!r} is not supported; allowed: a number "
                              ">= 0 (0: prompts never wait), or None (1.0 with CUDA graphs)")
        if not is_seconds(kv_release_after_s):
            raise ConfigError(f"kv_release_after_s={kv_release_after_s!r} is not supported; allowed: seconds >= 0 "
                              "(0: give spare KV memory back at once)")
        if fuse_projections is None:  # like compile_model: a model object stays as handed over
            fuse_projections = device.type == "cuda" and loaded_here and can_fuse(model)
        elif not isinstance(fuse_projections, bool):
            raise ConfigError(f"fuse_projections={fuse_projections!r} is not supported; allowed: True, False or None "
                              "(None: on for CUDA devices when LLM loads the model itself)")
        if column_major_weights is None:  # like fuse_projections: a model object stays as handed over
            column_major_weights = device.type == "cuda" and loaded_here and can_compile(model)
        elif not isinstance(column_major_weights, bool):
            raise ConfigError(f"column_major_weights={column_major_weights!r} is not supported; allowed: True, False "
                              "or None (None: on for CUDA devices when LLM loads the model itself)")
        if not isinstance(keep_prefix_cache, bool):
            raise ConfigError(f"keep_prefix_cache={keep_prefix_cache!r} is not supported; allowed: True or False")
        # The pool's growth leaves one step's activations free on CUDA (another tenant may hold the rest).
        headroom = (step_headroom(text_config, budgets.largest, max_num_seqs,
                                  next(model.parameters()).element_size()) if device.type == "cuda" else 0)
        memory = kv_budget(kv_cache_memory, device, gpu_memory_utilization, headroom)
        config = CacheConfig.from_model(model, max_batch_size=max_num_seqs, max_seq_len=max_model_len,
                                        block_size=block_size, memory_budget=memory, device=device)
        config = dataclasses.replace(config, chunk_blocks=growth_chunk_blocks(config.max_num_blocks, POOL_CHUNKS))
        prefill_varlen = choose_prefill_attention(prefill_attention, device, config.dtype, config.head_dim)
        if device.type == "cuda":
            logger.info("prefill chunks attend through %s", {"fa4": "FlashAttention-4 (flash-attn-4)",
                                                              "flash": "torch's flash varlen"}[prefill_varlen])
        cache = PagedKVCache(config, release_after_s=float(kv_release_after_s), device_headroom_bytes=headroom,
                             enable_prefix_caching=enable_prefix_caching,
                             keep_prefixes=keep_prefix_cache and enable_prefix_caching)
        self.engine = LLMEngine(model, tokenizer, cache, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=budgets.step, max_model_len=max_model_len,
                                prefill_only_batched_tokens=budgets.prefill_only_step,
                                cuda_graphs=cuda_graphs, compile_model=compile_model, async_scheduling=async_scheduling,
                                context_cost=context_cost(text_config) if context_aware_chunks else 0.0,
                                prefill_delay_factor=float(prefill_delay_factor), fuse_projections=fuse_projections,
                                scheduling_policy=scheduling_policy,
                                prefill_varlen=prefill_varlen, column_major_weights=column_major_weights)
        logger.info("KV cache: %s for up to %d blocks of %d tokens (%s each) on %s", format_bytes(memory),
                    config.max_num_blocks, block_size, format_bytes(config.block_bytes), device)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The tokenizer (vLLM's LLM.get_tokenizer); None for an engine on token ids alone."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest prompt + max_tokens a request may have."""
        return self.engine.max_model_len

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.engine.cache.config.block_size

    @property
    def device(self) -> torch.device:
        """Where the model and its KV cache live."""
        return self.engine.cache.config.device

    @property
    def device_uuid(self) -> str | None:
        """The GPU's UUID (which physical device this is, whatever CUDA_VISIBLE_DEVICES numbers it); None on the CPU."""
        if self.device.type != "cuda":
            return None
        return str(torch.cuda.get_device_properties(self.device).uuid)

    @property
    def vocab_size(self) -> int:
        """Token ids this engine accepts: 0 .. vocab_size - 1."""
        return self.engine.vocab_size

    def publish_prefix_events(self, capacity: int) -> PrefixEventLog:
        """Start recording which prefix blocks the cache stores and drops (for a prefix-aware router);
        the log keeps the newest `capacity` events. Until called, nothing is recorded."""
        log = PrefixEventLog(capacity)
        self.engine.cache.record_prefix_events(log)
        return log

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request=None, priority: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order. A prompt is text, token ids, or
        vLLM's {"prompt": text} / {"prompt_token_ids": ids}. A prompt refused stops the call and
        takes back the ones added before it, as vLLM does: nothing of this call runs later.
        priority: one per prompt (scheduling_policy "priority"); lora_request: None only (vLLM's)."""
        _refuse_lora(lora_request)
        prompts = _prompt_list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(params) != len(prompts) or len(priorities) != len(prompts):
            raise ConfigError(f"got {len(params)} sampling_params and {len(priorities)} priorities for "
                              f"{len(prompts)} prompts; allowed: one each (or one sampling_params for all)")
        engine = self.engine
        requests = []
        progress = None
        try:
            for prompt, sp, rank in zip(prompts, params, priorities):
                requests.append(engine.add_request(prompt, sp or SamplingParams(), priority=rank))
            if use_tqdm:
                from tqdm import tqdm

                progress = tqdm(total=len(requests), desc="generate", unit="req")
            while engine.has_unfinished():
                done = sum(o.done for o in engine.step())
                if progress is not None and done:
                    progress.update(done)
        except BaseException:
            for request in requests:  # never leak blocks or queued requests, whatever interrupted us
                engine.abort(request.request_id)
                engine.forget(request.request_id)
            raise
        finally:
            if progress is not None:
                progress.close()
        outputs = [engine.output(r) for r in requests]
        for request in requests:
            engine.forget(request.request_id)
        return outputs

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search (engine/beam_search.py): a prompt's beam_width best sequences, best
        first; each step every live beam runs as a one-token request, its prefix found in the cache.
        prompts: as generate takes them; concurrency_limit: prompts searched at once (None: all)."""
        _refuse_lora(lora_request)
        if not isinstance(params, BeamSearchParams):
            raise ConfigError(f"params must be a ponytail.BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or
                                              not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ConfigError(f"concurrency_limit={concurrency_limit!r} is not supported; allowed: an integer >= 1 "
                              "or None")
        prompts = _prompt_list(prompts)
        unpacked = [unpack_prompt(prompt) for prompt in prompts]
        token_lists = [self.engine.prompt_token_ids(prompt) for prompt, _ in unpacked]
        for tokens in token_lists:
            if len(tokens) + params.max_tokens > self.max_model_len:
                raise ConfigError(f"a prompt of {len(tokens)} tokens and max_tokens={params.max_tokens} exceed "
                                  f"max_model_len={self.max_model_len}; allowed: at most that many in all")
        decode = None if self.tokenizer is None else partial(self.tokenizer.decode, skip_special_tokens=True)
        limit = concurrency_limit or max(1, len(prompts))
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=cdiv(len(prompts), limit) * params.max_tokens, desc="beam search", unit="step")
        results: list[BeamSearchOutput] = []
        try:
            for start in range(0, len(prompts), limit):
                salts = [salt for _, salt in unpacked[start: start + limit]]

                def step(beams, sampling, salts=salts):
                    return self.generate([{"prompt_token_ids": tokens, **({"cache_salt": salts[index]}
                                                                         if salts[index] else {})}
                                          for index, tokens in beams], sampling)

                results += beam_search(step, token_lists[start: start + limit], params, self.engine.eos_token_ids,
                                       decode, on_step=progress.update if progress is not None else None)
        finally:
            if progress is not None:
                progress.close()
        return results

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False, *,
             tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
             chat_template: str | None = None, documents: list[dict[str, str]] | None = None,
             lora_request=None) -> list[RequestOutput]:
        """Answer a conversation (a list of {"role", "content"} messages) or a list of them, as
        vLLM's LLM.chat: the tokenizer's chat template (or `chat_template`, a template's text)
        renders each (with `tools`, the template's `chat_template_kwargs`, the assistant's answer
        opened or, with continue_final_message, the last message continued), then generate runs
        the token ids. One output per conversation. documents: for templates that read them (RAG)."""
        _refuse_lora(lora_request)
        if self.tokenizer is None:
            raise ConfigError("messages need a chat template, and this model has no tokenizer; allowed: a model "
                              "with a tokenizer, or generate() with token ids")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            check_chat_template_options(chat_template_kwargs, add_generation_prompt, continue_final_message,
                                        conversation)
            prompts.append(render_chat(self.tokenizer, conversation, tokenize=True, tools=tools,
                                          add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message,
                                          chat_template_kwargs=chat_template_kwargs, chat_template=chat_template,
                                          documents=documents))
        return self.generate(prompts, sampling_params, use_tqdm)

    def stats(self) -> EngineStats:
        return self.engine.stats()



def _prompt_list(prompts) -> list:
    """One prompt (text, token ids or a vLLM prompt dict) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return prompts


def _refuse_lora(lora_request) -> None:
    if lora_request is not None:
        raise ConfigError(f"lora_request={lora_request!r:.60} is not supported; allowed: None (the model's own "
                          "weights)")


def _vllm_options(loaded_here: bool, cuda_graphs, compile_model, enforce_eager, seed, tensor_parallel_size,
                  revision, trust_remote_code) -> tuple[bool | None, bool | None]:
    """vLLM's LLM arguments that mean something here, checked: (cuda_graphs, compile_model) after
    enforce_eager; seed seeds torch's generators, which requests without their own seed draw from."""
    if not isinstance(enforce_eager, bool):
        raise ConfigError(f"enforce_eager={enforce_eager!r} is not supported; allowed: True or False")
    if enforce_eager:
        if cuda_graphs or compile_model:
            raise ConfigError(f"enforce_eager=True runs the model eagerly, but cuda_graphs={cuda_graphs!r} and "
                              f"compile_model={compile_model!r} ask otherwise; allowed: one or the other")
        cuda_graphs, compile_model = False, False
    if isinstance(tensor_parallel_size, bool) or tensor_parallel_size != 1:
        raise ConfigError(f"tensor_parallel_size={tensor_parallel_size!r} is not supported; allowed: 1 (an engine "
                          "runs on one device; serve across GPUs with one replica each: deployments/app.yaml)")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"seed={seed!r} is not supported; allowed: an int >= 0, or None")
        torch.manual_seed(seed)
    if not loaded_here and (revision is not None or trust_remote_code):
        given = f"revision={revision!r}" if revision is not None else "trust_remote_code=True"
        raise ConfigError(f"{given} applies when LLM loads the model (a name or path), not to a model object")
    return cuda_graphs, compile_model
