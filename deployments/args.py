"""The app's arguments: one typed, validated definition for app.yaml, `serve run` and the CLI.

A pydantic model because Serve converts an application's arguments only for pydantic: `serve run
deployments.app:build max_replicas=2` passes the string "2", which validation turns into 2.
`ponytail serve` makes one flag per field (`--max-replicas`), its help and default from here.
Unknown names are refused, so a typo is an error rather than a silently ignored argument.
"""

from __future__ import annotations

import math
import os
from typing import ClassVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

ROUTERS = {
    "kv_blocks": "deployments.router:KVBlockRouter",
    "power_of_two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",  # Serve's default
}
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"  # the embedded default model's name in the API


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
                                              "unset: what the device has free (2 GiB on a CPU)")
    max_num_seqs: int = Field(64, description="sequences one replica runs at once")
    max_model_len: int | None = Field(None, description="longest prompt + output in tokens; unset: "
                                      "the model's")
    block_size: int = Field(16, description="tokens per KV block")
    min_replicas: int = Field(1, description="engine replicas Serve's autoscaler keeps at least")
    max_replicas: int = Field(2, description="engine replicas Serve's autoscaler starts at most")
    target_ongoing_requests: float = Field(16, description="requests per replica the autoscaler aims at")
    max_queued_requests: int = Field(256, description="requests queued beyond this get 503")
    stats_period_s: float = Field(0.2, description="how often replicas report free KV blocks to the "
                                  "router, seconds")
    router: str = Field("kv_blocks", description="kv_blocks (deployments.router) | power_of_two "
                        "(Serve's default, to compare)")
    max_hold_s: float = Field(10.0, description="kv_blocks: longest wait in the router while no replica "
                              "has room, seconds (0: never)")
    compile_model: bool = Field(False, description="torch.compile the decoder layers: ~21% more decode "
                                "tokens/s on a 7B (H200), slower start")
    stream_interval_s: float = Field(0.05, description="a stream's deltas merged over this long, seconds "
                                     "(first token and end not held)")

    # What EngineReplica takes as is; build() adds the device and the served name (model_id there).
    ENGINE_FIELDS: ClassVar[tuple[str, ...]] = ("model", "kv_cache_memory", "max_num_seqs", "max_model_len",
                                                "block_size", "compile_model", "stream_interval_s")

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device={value!r} is not supported; allowed: auto, cuda, cpu")
        return value

    @field_validator("router")
    @classmethod
    def _router(cls, value: str) -> str:
        if value not in ROUTERS:
            raise ValueError(f"router={value!r} is not supported; allowed: {', '.join(ROUTERS)}")
        return value

    @field_validator("compile_model", mode="before")
    @classmethod
    def _compile_model(cls, value: object) -> object:
        # pydantic would take "yes" or 1 as true; keep app.yaml's booleans booleans ("true" from the
        # command line included, as pydantic reads it).
        if not isinstance(value, bool) and str(value).lower() not in ("true", "false"):
            raise ValueError(f"compile_model={value!r} is not supported; allowed: true, false")
        return value

    @field_validator("max_hold_s")
    @classmethod
    def _max_hold(cls, value: float) -> float:
        if not _seconds(value):
            raise ValueError(f"max_hold_s={value:g} is not supported; allowed: seconds >= 0 (0: never hold)")
        return value

    @field_validator("stream_interval_s")
    @classmethod
    def _stream_interval(cls, value: float) -> float:
        if not _seconds(value, most=1):
            raise ValueError(f"stream_interval_s={value:g} is not supported; allowed: seconds from 0 to 1 "
                             "(0: a message per engine step)")
        return value

    @field_validator("max_num_seqs", "block_size", "max_queued_requests", "max_model_len")
    @classmethod
    def _positive(cls, value: int | None, info) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"{info.field_name}={value} is not supported; allowed: an integer >= 1")
        return value

    @model_validator(mode="after")
    def _replicas(self) -> AppArgs:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas}, max_replicas={self.max_replicas}: "
                             "need 1 <= min_replicas <= max_replicas")
        return self

    def served_name(self) -> str:
        """What clients put in "model": a hub id stays whole (clients load its tokenizer by it)."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return DEFAULT_SERVED_NAME
        if os.path.exists(os.path.expanduser(self.model)):
            return os.path.basename(self.model.rstrip("/"))
        return self.model


def _seconds(value: float, most: float = math.inf) -> bool:
    return math.isfinite(value) and 0 <= value <= most
