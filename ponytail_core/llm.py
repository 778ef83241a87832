"""`ponytail.LLM`: offline batched generation with the vLLM-style API users already know."""

from __future__ import annotations

import dataclasses
import logging
from functools import partial
from typing import Any

import torch

from .config import EngineConfig, ModelFacts
from .kv.config import CacheConfig, growth_chunk_blocks
from .errors import ConfigError
from .models.chat_template import check_chat_template_options, render_chat
from .engine.llm_engine import LLMEngine
from .engine.stats import EngineStats
from .models.kv_scales import set_kv_scales
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
from .utils.dtypes import dtype_name
from .utils.units import format_bytes
from .utils.arith import cdiv

logger = logging.getLogger("ponytail.engine")

POOL_CHUNKS = 64  # the pool grows and shrinks in steps of about 1/64 of its budget


class LLM:
    """A model, a paged KV cache and a continuous-batching engine.

    llm = ponytail.LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], ponytail.SamplingParams(max_tokens=32))

    model: a local checkpoint directory, a .gguf file, a hub id, None (the embedded default) or a
    loaded transformers model (which stays as handed over: no compiling, fusing or relayout unless
    asked). tokenizer: a tokenizer, or a name or path to load one from (vLLM's); None: the model's.
    kwargs: the fields of `ponytail.config.EngineConfig` by name (max_num_seqs=, kv_cache_memory=,
    ...; `tuning={...}` for TuningConfig's), each documented there and in docs/configuration.md.
    """

    def __init__(self, model: Any = None, *, tokenizer: Any = None, **kwargs: Any):
        config = EngineConfig.from_kwargs(**kwargs)  # before seconds of loading
        loaded_here = model is None or isinstance(model, str)
        options = config.model
        if not loaded_here and (options.revision is not None or options.trust_remote_code):
            given = f"revision={options.revision!r}" if options.revision is not None else "trust_remote_code=True"
            raise ConfigError(f"{given} applies when LLM loads the model (a name or path), not to a model object")
        if options.seed is not None:
            torch.manual_seed(options.seed)
        if loaded_here:
            model, tokenizer_loaded = load_model(model, device=options.device, dtype=options.dtype,
                                                 revision=options.revision, trust_remote_code=options.trust_remote_code)
            tokenizer = tokenizer_loaded if tokenizer is None else tokenizer
        if isinstance(tokenizer, str):  # vLLM's tokenizer=<name or path>
            tokenizer = load_tokenizer(tokenizer)
        # A model object without a tokenizer runs on token ids alone (like vLLM's skip_tokenizer_init).
        device = next(model.parameters()).device
        text_config = model.config.get_text_config()
        facts = ModelFacts(loaded_here=loaded_here, compilable=can_compile(model), fusable=can_fuse(model),
                           max_position_embeddings=int(getattr(text_config, "max_position_embeddings", 2048)))
        config = config.resolved(device.type, facts)
        scheduler, cache_options = config.scheduler, config.cache
        # The pool's growth leaves one step's activations free on CUDA (another tenant may hold the rest).
        largest_step = max(scheduler.max_num_batched_tokens, config.tuning.prefill_only_batched_tokens)
        headroom = (step_headroom(text_config, largest_step, scheduler.max_num_seqs,
                                  next(model.parameters()).element_size()) if device.type == "cuda" else 0)
        memory = kv_budget(cache_options.kv_cache_memory, device, cache_options.gpu_memory_utilization, headroom)
        shape = CacheConfig.from_model(model, max_batch_size=scheduler.max_num_seqs,
                                       max_seq_len=config.model.max_model_len, block_size=cache_options.block_size,
                                       memory_budget=memory, device=device, kv_cache_dtype=cache_options.kv_cache_dtype)
        shape = dataclasses.replace(shape, chunk_blocks=growth_chunk_blocks(shape.max_num_blocks, POOL_CHUNKS))
        runner = dataclasses.replace(config.runner, prefill_attention=choose_prefill_attention(
            config.runner.prefill_attention, device, shape.dtype, shape.head_dim))
        self.config = config = dataclasses.replace(config, runner=runner)  # every field resolved
        if device.type == "cuda":
            kernel = {"fa4": "FlashAttention-4 (flash-attn-4)", "flash": "torch's flash varlen"}[runner.prefill_attention]
            logger.info("prefill chunks attend through %s", kernel)
        cache = PagedKVCache(shape, release_after_s=float(cache_options.kv_release_after_s),
                             device_headroom_bytes=headroom, enable_prefix_caching=cache_options.enable_prefix_caching,
                             keep_prefixes=cache_options.keep_prefix_cache and cache_options.enable_prefix_caching)
        self.engine = LLMEngine(model, tokenizer, cache, config)
        if cache.storage.scales is not None:  # after the warm-up, whose dummy K/V must not set them
            set_kv_scales(cache.storage.scales, model, calculate=cache_options.calculate_kv_scales)
        logger.info("KV cache: %s for up to %d blocks of %d tokens (%s each, %s) on %s", format_bytes(memory),
                    shape.max_num_blocks, shape.block_size, format_bytes(shape.block_bytes),
                    dtype_name(shape.kv_dtype), device)

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

