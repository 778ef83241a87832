"""The app's arguments: one typed, validated definition for app.yaml, `serve run` and `ponytail serve`.

A pydantic model because Serve converts an application's arguments only for pydantic: `serve run
deployments.app:build max_replicas=2` passes the string "2", which validation turns into 2. The
fields are the app's own (replicas, routing, access, limits), a replica's serving options
(ReplicaOptions, inherited), and `engine`: `ponytail.LLM`'s arguments, checked by the engine's own
configuration (ponytail.config.EngineConfig), never restated here. `ponytail serve` makes one flag
per field (the engine's flat beside them). Unknown names are refused, so a typo is an error.
"""

from __future__ import annotations

import math
import os
from typing import Any

from pydantic import Field, field_validator, model_validator

from ponytail import ConfigError, is_seconds
from ponytail.config import EngineConfig, default_max_num_seqs

from deployments.api.http_guard import API_KEY_ENV, AccessPolicy
from deployments.api.limits import RequestLimits

from .replica_options import ReplicaOptions, from_json, on_off_or_auto, served_name
from .routing_stats import ADMISSIONS

ROUTERS = {
    "kv_blocks": "deployments.app.router:KVBlockRouter",
    "prefix": "deployments.app.prefix_router:PrefixAffinityRouter",  # kv_blocks plus prefix-cache affinity
    "power_of_two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",  # Serve's default
}
CPU_TARGET_ONGOING = 16  # a CPU step's time grows with its rows: scale out before a batch fills
LIMIT_FIELDS = ("max_body_bytes", "max_prompt_tokens", "max_output_tokens", "max_n", "max_stop", "max_stop_chars")


class AppArgs(ReplicaOptions):
    """The `args:` of app.yaml (all optional); `description` is the CLI's help for each."""

    model: str | None = Field(None, description="a local checkpoint directory, a .gguf file or a hub id "
                              "(ORG/NAME, through the hub cache); unset: the embedded SmolLM2-135M-Instruct")
    engine: dict[str, Any] = Field(default_factory=dict, description="ponytail.LLM's arguments for every replica's "
                                   "engine (device, kv_cache_memory, max_num_seqs, ...: docs/configuration.md); a "
                                   "JSON object from the command line")
    min_replicas: int = Field(1, description="engine replicas Serve's autoscaler keeps at least")
    max_replicas: int = Field(2, ge=1, description="engine replicas Serve's autoscaler starts at most")
    num_gpus: float | None = Field(None, description="GPUs per engine replica as Ray counts them (0.5: two "
                                   "replicas per GPU, each with its own kv_cache_memory); unset: the engine's "
                                   "gpu_memory_utilization, else 1")
    api_key: str | None = Field(None, description=f"the Bearer key every route but /health requires; unset: "
                                f"{API_KEY_ENV} from the environment, else no key (and only this machine served)")
    cors_origins: list[str] = Field(default_factory=list, description="browser origins allowed to call the API; "
                                    "none: no CORS headers")
    open_access: bool = Field(False, description="without api_key, serve clients on other machines too (only "
                              "behind a gateway that authenticates them); false: they get 403 until a key is set")
    metrics_without_key: bool = Field(False, description="with api_key, /metrics answers scrapers that send no key "
                                      "(every other route but /health asks for it)")
    body_timeout_s: float = Field(30.0, description="a request body that has not all arrived within this many "
                                  "seconds gets 408 (slow clients hold no connection longer)")
    ingress_replicas: int = Field(1, ge=1, description="OpenAI ingress replicas; more than 1: a separate ingress "
                                  "deployment (api_in_engines off) spreading many streams' per-delta work over "
                                  "processes; each takes one CPU and queues up to max_queued_requests")
    api_in_engines: bool | None = Field(None, description="serve the OpenAI API from the engine replicas "
                                        "themselves (one Ray hop per stream message) instead of a separate ingress "
                                        "deployment (two hops); unset: on, except with router prefix (it reads "
                                        "each prompt before placing it) or ingress_replicas > 1")
    target_ongoing_requests: float | None = Field(
        None, description="requests per replica the autoscaler aims at; unset: max_num_seqs on a GPU (a new "
                          f"replica when one's batch is full), {CPU_TARGET_ONGOING} on a CPU")
    max_queued_requests: int = Field(256, ge=1, description="requests waiting for a replica (router hold "
                                     "included); beyond this: 503")
    max_ongoing_requests: int | None = Field(None, ge=1, description="per replica, running + queued in its engine; "
                                             "unset: 2 x max_num_seqs")
    retry_after_s: float = Field(1.0, description="the Retry-After of a 503, seconds")
    shutdown_timeout_s: float = Field(10.0, description="on shutdown engine replicas finish their streams for "
                                      "this long, then every open stream gets an error event and [DONE]")
    router: str = Field("kv_blocks", description="kv_blocks (by free KV blocks) | prefix (kv_blocks plus "
                        "prefix-cache affinity) | power_of_two (Serve's default, to compare)")
    stats_period_s: float = Field(0.2, description="how often replicas report free KV blocks to the router, seconds")
    max_hold_s: float = Field(10.0, description="kv_blocks, prefix: longest wait in the router while no replica "
                              "has room, seconds (0: never)")
    router_admission: str = Field("engine", description="kv_blocks, prefix: how a request's KV blocks are counted; "
                                  "engine (its prompt, against what the engine would admit now) | max_tokens "
                                  "(prompt + max_tokens reserved: never a preemption, requests wait longer)")
    prefix_weight: float = Field(2.0, description="prefix: what a fully cached prompt weighs against pool use "
                                 "and load (each 0-1); 0: no affinity")
    max_body_bytes: int = Field(4 << 20, description="request bodies beyond this get 413")
    max_output_tokens: int | None = Field(None, description="the largest max_tokens; unset: the context")
    max_n: int = Field(16, description="the largest n and best_of (samples per prompt)")
    max_stop: int = Field(16, description="stop strings per request")
    max_stop_chars: int = Field(256, description="characters per stop string")

    @field_validator("engine", mode="before")
    @classmethod
    def _engine(cls, value: Any) -> Any:
        """A mapping of LLM arguments (a JSON object's text from the command line), checked by the
        engine's own configuration: an unknown name lists the allowed ones."""
        value = from_json("engine", value, '{"max_num_seqs": 64}')
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError(f"engine={value!r:.80} is not supported; allowed: a mapping of LLM arguments")
        try:
            EngineConfig.from_kwargs(**value)
        except ConfigError as exc:
            raise ValueError(f"engine: {exc}") from None
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

    @field_validator("api_in_engines", mode="before")
    @classmethod
    def _api_in_engines(cls, value: object, info) -> object:
        return on_off_or_auto(value, info.field_name)

    @field_validator("max_hold_s", "stats_period_s")
    @classmethod
    def _seconds(cls, value: float, info) -> float:
        if not is_seconds(value):
            raise ValueError(f"{info.field_name}={value:g} is not supported; allowed: seconds >= 0 (0: never hold)")
        return value

    @field_validator("retry_after_s", "shutdown_timeout_s", "body_timeout_s")
    @classmethod
    def _positive_seconds(cls, value: float, info) -> float:
        if not is_seconds(value) or value <= 0:
            raise ValueError(f"{info.field_name}={value:g} is not supported; allowed: seconds > 0")
        return value

    @field_validator("prefix_weight")
    @classmethod
    def _prefix_weight(cls, value: float) -> float:
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"prefix_weight={value:g} is not supported; allowed: a number >= 0 (0: no affinity)")
        return value

    @field_validator("num_gpus")
    @classmethod
    def _num_gpus(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"num_gpus={value:g} is not supported; allowed: a number > 0 (fractions share a GPU), "
                             "or null")
        return value

    @model_validator(mode="after")
    def _together(self) -> AppArgs:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas}, max_replicas={self.max_replicas}: "
                             "need 1 <= min_replicas <= max_replicas")
        if self.api_in_engines and (self.router == "prefix" or self.ingress_replicas > 1):
            raise ValueError(f"api_in_engines=true with router={self.router!r}, ingress_replicas="
                             f"{self.ingress_replicas}: the prefix router places a request by its prompt, which "
                             "Serve's proxy does not show a router, and ingress replicas need the separate "
                             "ingress; allowed: api_in_engines false or null with router prefix or "
                             "ingress_replicas > 1")
        self.limits()  # ValueError naming a bad limit
        return self

    def limits(self) -> RequestLimits:
        return RequestLimits(**{name: getattr(self, name) for name in LIMIT_FIELDS})

    def access(self) -> AccessPolicy:
        """The HTTP gate's policy; the API key from the args, else from PONYTAIL_API_KEY."""
        return AccessPolicy(api_key=self.api_key or os.environ.get(API_KEY_ENV) or None,
                            cors_origins=list(self.cors_origins), max_body_bytes=self.max_body_bytes,
                            body_timeout_s=self.body_timeout_s, open_access=self.open_access,
                            metrics_without_key=self.metrics_without_key)

    def replica_options(self) -> dict[str, Any]:
        """EngineReplica's serving options (ReplicaOptions' fields) as these args set them."""
        return {name: getattr(self, name) for name in ReplicaOptions.model_fields}

    def engine_on(self, gpu: bool) -> dict[str, Any]:
        """The replicas' LLM arguments: on a CPU cluster a CPU engine (no GPU share to take)."""
        engine = {**self.engine, "device": "cuda" if gpu else "cpu"}
        if not gpu:
            engine.pop("gpu_memory_utilization", None)
        return engine

    def max_num_seqs(self, gpu: bool) -> int:
        """Sequences one replica's engine runs at once (the engine's default for the device unless set)."""
        return self.engine.get("max_num_seqs") or default_max_num_seqs("cuda" if gpu else "cpu")

    def target_ongoing(self, gpu: bool) -> float:
        return self.target_ongoing_requests or (self.max_num_seqs(gpu) if gpu else CPU_TARGET_ONGOING)

    def replica_max_ongoing_requests(self, gpu: bool) -> int:
        return self.max_num_seqs(gpu) * 2 if self.max_ongoing_requests is None else self.max_ongoing_requests

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
        return self.num_gpus or self.engine.get("gpu_memory_utilization") or 1

    def served_name(self) -> str:
        return served_name(self.model, self.served_model_name)
