"""The app's arguments: one typed, validated definition for app.yaml, `serve run` and the CLI.

A pydantic model because Serve converts an application's arguments only for pydantic: `serve run
deployments.app:build max_replicas=2` passes the string "2", which validation turns into 2.
`ponytail serve` makes one flag per field (`--max-replicas`), its help and default from here.
Unknown names are refused, so a typo is an error rather than a silently ignored argument.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ponytail import DEFAULT_BLOCK_SIZE, ConfigError, check_chat_template_options, is_chat_template, is_seconds

from .http_guard import API_KEY_ENV, AccessPolicy
from .limits import RequestLimits
from .protocol import ADMISSIONS

ROUTERS = {
    "kv_blocks": "deployments.router:KVBlockRouter",
    "prefix": "deployments.prefix_router:PrefixAffinityRouter",  # kv_blocks plus prefix-cache affinity
    "power_of_two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",  # Serve's default
}
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"  # the embedded default model's name in the API
# Device-sized defaults: a GPU engine's step costs about the same for 64 or 256 decode rows (small
# models are host-bound), so a GPU replica batches wide; a CPU step's time grows with its rows.
GPU_MAX_NUM_SEQS = 256
CPU_MAX_NUM_SEQS = 64
CPU_TARGET_ONGOING = 16


class AppArgs(BaseModel):
    """The `args:` of app.yaml (all optional); `description` is the CLI's help for each."""

    model_config = ConfigDict(extra="forbid", validate_default=True, populate_by_name=True)

    model: str | None = Field(None, description="a local checkpoint directory, a .gguf file or a hub id "
                              "(ORG/NAME, through the hub cache); unset: the embedded SmolLM2-135M-Instruct")
    served_model_name: str | None = Field(
        None, validation_alias=AliasChoices("served_model_name", "model_id"),  # model_id: its older name
        description="the name clients put in \"model\"; unset: the hub id, the directory's name, "
                    f"or {DEFAULT_SERVED_NAME}")
    device: str = Field("auto", description="auto | cuda | cpu: auto takes one GPU per replica when the "
                        "cluster has GPUs")
    kv_cache_memory: int | str | None = Field(None, description="KV cache per replica, bytes or \"4GiB\"; "
                                              "unset: vLLM's default share of the GPU (2 GiB on a CPU)")
    gpu_memory_utilization: float | None = Field(
        None, description="per replica: a share of the GPU's total memory (weights + KV), as vLLM's; also the "
                          "replica's num_gpus, so 0.45 puts two replicas on one GPU; excludes kv_cache_memory")
    num_gpus: float | None = Field(None, description="GPUs per engine replica as Ray counts them (0.5: two "
                                   "replicas per GPU, each with its own kv_cache_memory); unset: "
                                   "gpu_memory_utilization, else 1")
    max_num_seqs: int | None = Field(None, description="sequences one replica runs at once; unset: "
                                     f"{GPU_MAX_NUM_SEQS} on a GPU, {CPU_MAX_NUM_SEQS} on a CPU")
    max_model_len: int | None = Field(None, description="longest prompt + output in tokens; unset: "
                                      "the model's")
    block_size: int = Field(DEFAULT_BLOCK_SIZE, description="tokens per KV block")
    min_replicas: int = Field(1, description="engine replicas Serve's autoscaler keeps at least")
    max_replicas: int = Field(2, description="engine replicas Serve's autoscaler starts at most")
    ingress_replicas: int = Field(1, description="OpenAI ingress replicas, more than 1: a separate ingress "
                                  "deployment (api_in_engines off; HTTP, SSE, a Ray message per "
                                  "stream per delta): more spread many streams' per-delta work over processes; "
                                  "each takes one CPU and queues up to max_queued_requests toward the engines")
    target_ongoing_requests: float | None = Field(
        None, description="requests per replica the autoscaler aims at; unset: max_num_seqs on a GPU (a new "
                          f"replica when one's batch is full), {CPU_TARGET_ONGOING} on a CPU")
    max_queued_requests: int = Field(256, description="requests waiting for a replica (router hold included); "
                                     "beyond this: 503")
    max_ongoing_requests: int | None = Field(None, description="per replica, running + queued in its engine; "
                                             "unset: 2 x max_num_seqs")
    retry_after_s: float = Field(1.0, description="the Retry-After of a 503, seconds")
    shutdown_timeout_s: float = Field(10.0, description="on shutdown engine replicas finish their streams for "
                                      "this long, then every open stream gets an error event and [DONE]")
    stats_period_s: float = Field(0.2, description="how often replicas report free KV blocks to the "
                                  "router, seconds")
    router: str = Field("kv_blocks", description="kv_blocks (deployments.router) | prefix "
                        "(deployments.prefix_router: kv_blocks plus prefix-cache affinity) | power_of_two "
                        "(Serve's default, to compare)")
    max_hold_s: float = Field(10.0, description="kv_blocks: longest wait in the router while no replica "
                              "has room, seconds (0: never)")
    router_admission: str = Field("engine", description="kv_blocks, prefix: how a request's KV blocks are "
                                  "counted; engine (its prompt, against what the engine would admit now; running "
                                  "requests' growth is the engine's, which preempts when short) | max_tokens "
                                  "(prompt + max_tokens reserved: never a preemption, requests wait while blocks "
                                  "sit free)")
    prefix_weight: float = Field(2.0, description="prefix: what a fully cached prompt weighs against pool "
                                 "use and load (each 0-1); 0: no affinity")
    enforce_eager: bool = Field(False, description="run the model eagerly: no CUDA graphs, no torch.compile "
                                "(vLLM's --enforce-eager); excludes compile_model true")
    seed: int | None = Field(None, ge=0, description="seeds each replica's torch generators, which requests "
                             "without a seed of their own sample from (vLLM's --seed); unset: not seeded")
    revision: str | None = Field(None, min_length=1, description="a hub id's branch, tag or commit to serve "
                                 "(vLLM's --revision); its tokenizer and generation_config.json too; unset: main")
    trust_remote_code: bool = Field(False, description="run the model and tokenizer code a checkpoint ships "
                                    "(vLLM's --trust-remote-code)")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="fcfs: first come, first served; priority: requests' priority field orders the queue, "
                            "lower first, and preemption takes the least urgent (vLLM's --scheduling-policy)")
    compile_model: bool | None = Field(None, description="torch.compile the decoder layers (~21% more decode "
                                       "tokens/s on a 7B, H200; the first start compiles); unset: on for GPUs")
    fuse_projections: bool | None = Field(None, description="one GEMM for q/k/v and one for gate/up in every "
                                          "decoder layer (2-3% more decode tokens/s on a 7B, H200); unset: on for GPUs")
    column_major_weights: bool | None = Field(None, description="projection weights stored column-major and "
                                              "multiplied through cuBLASLt (7% faster decode GEMMs at 64 rows on a "
                                              "7B, H200: 1.9% more decode tokens/s); unset: on for GPUs")
    prefill_attention: Literal["flash", "fa4"] | None = Field(
        None, description="the kernel that attends prompt chunks on GPUs: flash (torch's FlashAttention-2) or fa4 "
                          "(FlashAttention-4, pip install 'ponytail[fa4]'); unset: fa4 where installed on Hopper or "
                          "Blackwell with head_dim >= 128, else flash")
    engine_process: bool | None = Field(None, description="run each replica's engine step loop in a process of its "
                                        "own (vLLM's engine core), so streaming does not slow the steps; unset: on "
                                        "for GPUs")
    api_in_engines: bool | None = Field(None, description="serve the OpenAI API from the engine replicas "
                                        "themselves (proxy -> engine replica: one Ray hop per stream message) "
                                        "instead of a separate ingress deployment (two hops); unset: on, except "
                                        "with router prefix (it reads each prompt before placing it) or "
                                        "ingress_replicas > 1")
    prefill_delay_factor: float | None = Field(
        None, description="while requests decode, new prompts wait until the oldest has waited this many times what "
                          "a step with a prompt costs beyond a decode step's CUDA graph (measured at start-up; at "
                          "most 0.1 s) and then share one step: steps with a prefill run without CUDA graphs; "
                          "unset: 1.0 with CUDA graphs (GPUs), 0 on CPUs")
    generation_config: Literal["auto", "ponytail"] = Field(
        "auto", description="auto: requests that leave temperature, top_p, top_k, min_p or repetition_penalty "
                            "unset get the model's generation_config.json values (vLLM's default); ponytail: "
                            "SamplingParams' own defaults")
    chat_template: str | None = Field(None, description="a Jinja chat template, or the path of a file holding one, "
                                      "served instead of the tokenizer's (vLLM's --chat-template); a file is read "
                                      "where the app is built, so replicas on other nodes need no copy")
    tool_call_parser: Literal["auto", "hermes", "qwen3_coder", "llama3_json", "mistral", "pythonic", "glm45", "glm47",
                              "none"] = Field(
        "auto", description="how tool_choice auto reads calls from the model's text (vLLM's --tool-call-parser): "
                            "auto finds the format from the chat template (<arg_key>: glm45, GLM-4.5 to 4.7's "
                            "name and key/value pairs, as glm47 does; <tool_call>: hermes, which also reads "
                            "Qwen3-Coder's <function=...> XML, as qwen3_coder does; <|python_tag|>: "
                            "llama3_json, [TOOL_CALLS]: mistral, none of them: auto refused); pythonic (Llama 3.2/4's "
                            "[f(a=1)]) only when set; none reads no calls")
    default_chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="names every chat request's template gets unless the request sets them (vLLM's "
                          "--default-chat-template-kwargs), e.g. {\"enable_thinking\": false}; a JSON object as a flag")
    reasoning_parser: Literal["auto", "deepseek_r1", "qwen3", "none"] = Field(
        "auto", description="how a reasoning model's thought is split from its answer into the response's "
                            "`reasoning` (vLLM's --reasoning-parser): auto (templates with </think>) starts the "
                            "answer in thought where the generation prompt opens one, else only if it begins with "
                            "<think>; qwen3 and deepseek_r1 are vLLM's rules; none leaves the thought in the content")
    stream_interval_s: float = Field(0.05, description="a stream's deltas merged over this long, seconds "
                                     "(first token and end not held)")
    max_deltas_per_s: float | None = Field(1000.0, description="messages all of a replica's streams send per "
                                           "second at most: with more streams open each merges over streams / "
                                           "this (never less than stream_interval_s); null: no bound")
    keep_prefix_cache: bool = Field(True, description="while requests run, a replica's KV pool grows within its "
                                    "budget rather than evict cached prompt prefixes (a chat's next turn finds its "
                                    "history); they go back with idle memory after 30 s without requests")
    api_key: str | None = Field(None, description=f"the Bearer key every /v1 route requires; unset: "
                                f"{API_KEY_ENV} from the environment, else no key")
    cors_origins: list[str] = Field(default_factory=list, description="browser origins allowed to call the API; "
                                    "none: no CORS headers")
    max_body_bytes: int = Field(4 << 20, description="request bodies beyond this get 413")
    max_prompt_tokens: int | None = Field(None, description="longest prompt in tokens; unset: the context "
                                          "(max_model_len)")
    max_output_tokens: int | None = Field(None, description="the largest max_tokens; unset: the context")
    max_n: int = Field(16, description="the largest n and best_of (samples per prompt)")
    max_stop: int = Field(16, description="stop strings per request")
    max_stop_chars: int = Field(256, description="characters per stop string")

    # What EngineReplica takes as is; build() adds the device and the served name (model_id there).
    ENGINE_FIELDS: ClassVar[tuple[str, ...]] = ("model", "kv_cache_memory", "max_num_seqs", "max_model_len",
                                                "block_size", "compile_model", "fuse_projections", "column_major_weights",
                                                "prefill_attention",
                                                "stream_interval_s", "max_deltas_per_s",
                                                "gpu_memory_utilization", "max_prompt_tokens",
                                                "keep_prefix_cache", "engine_process", "prefill_delay_factor",
                                                "generation_config", "chat_template", "tool_call_parser",
                                                "reasoning_parser", "default_chat_template_kwargs", "enforce_eager",
                                                "seed", "revision", "trust_remote_code", "scheduling_policy")
    LIMIT_FIELDS: ClassVar[tuple[str, ...]] = ("max_body_bytes", "max_prompt_tokens", "max_output_tokens", "max_n",
                                               "max_stop", "max_stop_chars")  # RequestLimits

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device={value!r} is not supported; allowed: auto, cuda, cpu")
        return value

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, value: str | None) -> str | None:
        """The template's text: a path is read here, on the machine that builds the app."""
        if value is None or is_chat_template(value):
            return value
        path = os.path.expanduser(value)
        if not os.path.isfile(path):
            raise ValueError(f"chat_template={value!r} is neither a file here nor a Jinja template (no '{{{{' or "
                             "'{%'); allowed: a template's text or the path of a file holding one")
        with open(path, encoding="utf-8") as file:
            text = file.read()
        if not is_chat_template(text):
            raise ValueError(f"chat_template={value!r}: the file holds no Jinja template (no '{{{{' or '{{%'); "
                             "allowed: a template's text or the path of a file holding one")
        return text

    @field_validator("default_chat_template_kwargs", mode="before")
    @classmethod
    def _template_defaults(cls, value):
        """A JSON object (a flag gives its text); names apply_chat_template sets itself are refused."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"default_chat_template_kwargs={value!r:.80} is not JSON ({exc}); allowed: a JSON "
                                 "object such as '{\"enable_thinking\": false}'") from None
        if value is not None:
            try:
                check_chat_template_options(value, True, False)
            except ConfigError as exc:
                raise ValueError(str(exc).replace("chat_template_kwargs", "default_chat_template_kwargs", 1)) from None
        return value

    @field_validator("router_admission")
    @classmethod
    def _router_admission(cls, value: str) -> str:
        if value not in ADMISSIONS:
            raise ValueError(f"router_admission={value!r} is not supported; allowed: {', '.join(ADMISSIONS)}")
        return value

    @field_validator("router")
    @classmethod
    def _router(cls, value: str) -> str:
        if value not in ROUTERS:
            raise ValueError(f"router={value!r} is not supported; allowed: {', '.join(ROUTERS)}")
        return value

    @field_validator("compile_model", "fuse_projections", "column_major_weights", "engine_process", "api_in_engines",
                     mode="before")
    @classmethod
    def _on_off_or_auto(cls, value: object, info: ValidationInfo) -> object:
        # pydantic would take "yes" or 1 as true; keep app.yaml's booleans booleans ("true" from the
        # command line included, as pydantic reads it).
        if value is None or isinstance(value, bool) or str(value).lower() in ("true", "false"):
            return value
        if str(value).lower() in ("null", "none"):
            return None
        raise ValueError(f"{info.field_name}={value!r} is not supported; allowed: true, false, null (on for GPUs)")

    @field_validator("prefill_delay_factor")
    @classmethod
    def _prefill_delay(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"prefill_delay_factor={value:g} is not supported; allowed: a number >= 0 (0: prompts "
                             "never wait), or null (1.0 on GPUs)")
        return value

    @field_validator("max_hold_s")
    @classmethod
    def _max_hold(cls, value: float) -> float:
        if not is_seconds(value):
            raise ValueError(f"max_hold_s={value:g} is not supported; allowed: seconds >= 0 (0: never hold)")
        return value

    @field_validator("prefix_weight")
    @classmethod
    def _prefix_weight(cls, value: float) -> float:
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"prefix_weight={value:g} is not supported; allowed: a number >= 0 (0: no affinity)")
        return value

    @field_validator("stream_interval_s")
    @classmethod
    def _stream_interval(cls, value: float) -> float:
        if not is_seconds(value, most=1):
            raise ValueError(f"stream_interval_s={value:g} is not supported; allowed: seconds from 0 to 1 "
                             "(0: a message per engine step)")
        return value

    @field_validator("max_deltas_per_s")
    @classmethod
    def _max_deltas(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"max_deltas_per_s={value:g} is not supported; allowed: a number > 0, or null (no bound)")
        return value

    @field_validator("max_num_seqs", "block_size", "max_queued_requests", "max_model_len", "ingress_replicas")
    @classmethod
    def _positive(cls, value: int | None, info) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"{info.field_name}={value} is not supported; allowed: an integer >= 1")
        return value

    @field_validator("max_ongoing_requests")
    @classmethod
    def _max_ongoing(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"max_ongoing_requests={value} is not supported; allowed: an integer >= 1 or null "
                             "(2 x max_num_seqs)")
        return value

    @field_validator("retry_after_s", "shutdown_timeout_s")
    @classmethod
    def _positive_seconds(cls, value: float, info) -> float:
        if not is_seconds(value) or value <= 0:
            raise ValueError(f"{info.field_name}={value:g} is not supported; allowed: seconds > 0")
        return value

    @field_validator("num_gpus")
    @classmethod
    def _num_gpus(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"num_gpus={value:g} is not supported; allowed: a number > 0 (fractions share a GPU), "
                             "or null")
        return value

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _gpu_share(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value <= 1:
            raise ValueError(f"gpu_memory_utilization={value:g} is not supported; allowed: a share of the GPU "
                             "in (0, 1], or null")
        return value

    @model_validator(mode="after")
    def _together(self) -> AppArgs:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas}, max_replicas={self.max_replicas}: "
                             "need 1 <= min_replicas <= max_replicas")
        if self.gpu_memory_utilization is not None and self.kv_cache_memory is not None:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory!r} and gpu_memory_utilization="
                             f"{self.gpu_memory_utilization!r}: allowed: one of them")
        if self.api_in_engines and (self.router == "prefix" or self.ingress_replicas > 1):
            raise ValueError(f"api_in_engines=true with router={self.router!r}, ingress_replicas="
                             f"{self.ingress_replicas}: the prefix router places a request by its prompt, which "
                             "Serve's proxy does not show a router, and ingress replicas need the separate "
                             "ingress; allowed: api_in_engines false or null with router prefix or "
                             "ingress_replicas > 1")
        if self.enforce_eager and self.compile_model:
            raise ValueError("enforce_eager=true and compile_model=true: allowed: one of them (enforce_eager runs "
                             "the model without torch.compile and CUDA graphs)")
        self.limits()  # ValueError naming a bad limit
        return self

    def limits(self) -> RequestLimits:
        return RequestLimits(**{name: getattr(self, name) for name in self.LIMIT_FIELDS})

    def access(self) -> AccessPolicy:
        """The HTTP gate's policy; the API key from the args, else from PONYTAIL_API_KEY."""
        return AccessPolicy(api_key=self.api_key or os.environ.get(API_KEY_ENV) or None,
                            cors_origins=list(self.cors_origins), max_body_bytes=self.max_body_bytes)

    def for_device(self, gpu: bool) -> AppArgs:
        """These args with the device-sized defaults filled in (what build() deploys)."""
        seqs = self.max_num_seqs or (GPU_MAX_NUM_SEQS if gpu else CPU_MAX_NUM_SEQS)
        target = self.target_ongoing_requests or (seqs if gpu else CPU_TARGET_ONGOING)
        return self.model_copy(update={"max_num_seqs": seqs, "target_ongoing_requests": target})

    @property
    def serves_api_in_engines(self) -> bool:
        """Whether the engine replicas serve HTTP themselves (api_in_engines; unset: unless router prefix
        or ingress_replicas > 1 ask for the separate ingress)."""
        if self.api_in_engines is not None:
            return self.api_in_engines
        return self.router != "prefix" and self.ingress_replicas == 1

    @property
    def replica_num_gpus(self) -> float:
        """The engine replica's num_gpus on a GPU cluster."""
        return self.num_gpus or self.gpu_memory_utilization or 1

    @property
    def replica_max_ongoing_requests(self) -> int:
        return self.max_num_seqs * 2 if self.max_ongoing_requests is None else self.max_ongoing_requests

    def served_name(self) -> str:
        """What clients put in "model": a hub id stays whole (clients load its tokenizer by it)."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return DEFAULT_SERVED_NAME
        if os.path.exists(os.path.expanduser(self.model)):
            return os.path.basename(self.model.rstrip("/"))
        return self.model
