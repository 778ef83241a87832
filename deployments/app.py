"""The Ponytail Serve application: `serve run deployments/app.yaml` imports `build` from here.

Two deployments: `EngineReplica` (one engine per replica, one GPU each on GPU clusters, the CPU
elsewhere), placed by the KV-block router; `OpenAIIngress` (FastAPI, the OpenAI-compatible API)
streaming from them through a handle. Other Ray apps call `generate` on the app handle directly.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, BackpressureConfig, RequestRouterConfig
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from ponytail.utils.units import is_seconds

from .http_guard import API_KEY_ENV, AccessPolicy
from .limits import RequestLimits
from .openai_api import BackendUnavailable, build_app
from .protocol import GenerateDelta, GenerateRequest, ModelInfo
from .replica import EngineReplica

logger = logging.getLogger("ponytail.serve")

INGRESS_SHUTDOWN_EXTRA_S = 10.0  # the ingress's graceful shutdown outlasts the engines' by this much

ROUTERS = {
    "kv_blocks": "deployments.router:KVBlockRouter",
    "power_of_two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",  # Serve's default
}


@dataclass(slots=True)
class AppArgs:
    """The `args:` of app.yaml (all optional)."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct; else a local checkpoint path
    model_id: str | None = None  # the name clients put in "model"
    device: str = "auto"  # auto | cuda | cpu: auto takes one GPU per replica when the cluster has GPUs
    kv_cache_memory: int | str | None = None  # per replica; None: what the device has free
    # per replica: a share of the GPU's total memory (weights + KV), as vLLM's; also the replica's
    # num_gpus, so 0.45 puts two replicas on one GPU. Excludes kv_cache_memory.
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None
    block_size: int = 16
    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing_requests: float = 16
    max_queued_requests: int = 256  # requests waiting for a replica (router hold included); beyond: 503
    max_ongoing_requests: int | None = None  # per replica (running + queued in its engine); None: 2 x max_num_seqs
    retry_after_s: float = 1.0  # Retry-After of a 503
    # Shutdown: engine replicas finish their streams for up to this long, then stop; the ingress
    # outlives them by INGRESS_SHUTDOWN_EXTRA_S, so each open stream gets an error event and [DONE].
    shutdown_timeout_s: float = 10.0
    stats_period_s: float = 0.2  # how often replicas report free KV blocks to the router
    router: str = "kv_blocks"  # kv_blocks (deployments.router) | power_of_two (Serve's default, to compare)
    max_hold_s: float = 10.0  # kv_blocks: longest wait in the router while no replica has room (0: never)
    compile_model: bool = False  # torch.compile the decoder layers: ~21% more decode tokens/s on a 7B (H200)
    stream_interval_s: float = 0.05  # a stream's deltas merged over this long (first token and end not held)
    # Access (see http_guard.py); api_key None: PONYTAIL_API_KEY from the environment, else no key
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)  # browser origins allowed; none: no CORS headers
    # Request limits (see limits.py): refused before any work
    max_body_bytes: int = 4 << 20  # 413 beyond
    max_prompt_tokens: int | None = None  # None: the context (max_model_len)
    max_output_tokens: int | None = None  # the largest max_tokens; None: the context
    max_n: int = 1
    max_stop: int = 16  # stop strings per request
    max_stop_chars: int = 256  # characters per stop string

    ENGINE_FIELDS = ("model", "model_id", "kv_cache_memory", "max_num_seqs", "max_model_len", "block_size",
                     "compile_model", "stream_interval_s", "gpu_memory_utilization",
                     "max_prompt_tokens")  # what EngineReplica takes, besides the device
    LIMIT_FIELDS = ("max_body_bytes", "max_prompt_tokens", "max_output_tokens", "max_n", "max_stop",
                    "max_stop_chars")  # RequestLimits

    def __post_init__(self):
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device={self.device!r} is not supported; allowed: auto, cuda, cpu")
        if self.router not in ROUTERS:
            raise ValueError(f"router={self.router!r} is not supported; allowed: {', '.join(ROUTERS)}")
        if not isinstance(self.compile_model, bool):
            raise ValueError(f"compile_model={self.compile_model!r} is not supported; allowed: true, false")
        hold = self.max_hold_s
        if not is_seconds(hold):
            raise ValueError(f"max_hold_s={hold!r} is not supported; allowed: seconds >= 0 (0: never hold)")
        interval = self.stream_interval_s
        if not is_seconds(interval, most=1):
            raise ValueError(f"stream_interval_s={interval!r} is not supported; allowed: seconds from 0 to 1 "
                             "(0: a message per engine step)")
        self.limits()  # ValueError naming a bad limit
        share = self.gpu_memory_utilization
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
            raise ValueError(f"gpu_memory_utilization={share!r} is not supported; allowed: a share of the GPU "
                             "in (0, 1], or null")
        if share is not None and self.kv_cache_memory is not None:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory!r} and gpu_memory_utilization={share!r}: "
                             "allowed: one of them")
        if self.max_ongoing_requests is not None and (isinstance(self.max_ongoing_requests, bool) or not isinstance(
                self.max_ongoing_requests, int) or self.max_ongoing_requests < 1):
            raise ValueError(f"max_ongoing_requests={self.max_ongoing_requests!r} is not supported; allowed: an "
                             "integer >= 1 or null (2 x max_num_seqs)")
        if not is_seconds(self.shutdown_timeout_s) or self.shutdown_timeout_s <= 0:
            raise ValueError(f"shutdown_timeout_s={self.shutdown_timeout_s!r} is not supported; allowed: seconds > 0")
        if not is_seconds(self.retry_after_s) or self.retry_after_s <= 0:
            raise ValueError(f"retry_after_s={self.retry_after_s!r} is not supported; allowed: seconds > 0")
        if not isinstance(self.cors_origins, list) or not all(isinstance(o, str) for o in self.cors_origins):
            raise ValueError(f"cors_origins={self.cors_origins!r} is not supported; allowed: a list of origins "
                             "such as ['https://app.example.com']")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas}, max_replicas={self.max_replicas}: "
                             "need 1 <= min_replicas <= max_replicas")


    def limits(self) -> RequestLimits:
        return RequestLimits(**{name: getattr(self, name) for name in self.LIMIT_FIELDS})

    def access(self) -> AccessPolicy:
        """The HTTP gate's policy; the API key from the args, else from PONYTAIL_API_KEY."""
        return AccessPolicy(api_key=self.api_key or os.environ.get(API_KEY_ENV) or None,
                            cors_origins=list(self.cors_origins), max_body_bytes=self.max_body_bytes)

    @property
    def replica_max_ongoing_requests(self) -> int:
        return self.max_num_seqs * 2 if self.max_ongoing_requests is None else self.max_ongoing_requests


@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress:
    """HTTP front: the OpenAI API (openai_api.build_app) over the engine replicas."""

    def __init__(self, engine: DeploymentHandle, retry_after_s: float = 1.0, limits: RequestLimits | None = None,
                 access: AccessPolicy | None = None):
        self.engine = engine
        self.retry_after_s = retry_after_s  # the Retry-After of a 503 when the engines' queue is full
        self.limits = limits or RequestLimits()
        self.access = access or AccessPolicy(max_body_bytes=self.limits.max_body_bytes)
        self._streams: dict[str, Any] = {}

    def __serve_build_asgi_app__(self):
        return build_app(self, self.limits, self.access)

    async def model_info(self) -> ModelInfo:
        try:
            return await self.engine.model_info.remote()
        except BackPressureError as exc:  # the engines' queue bounds this call too
            raise BackendUnavailable(f"all engine replicas are busy ({exc}); retry later",
                                     retry_after_s=self.retry_after_s) from None

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        response = self.engine.options(stream=True).generate.remote(request)
        self._streams[request.request_id] = response
        finished = False
        try:
            async for delta in response:
                finished = delta.finished
                yield delta
        except BackPressureError as exc:
            finished = True  # refused before any replica took it: nothing to cancel
            raise BackendUnavailable(f"all engine replicas are busy ({exc}); retry later",
                                     retry_after_s=self.retry_after_s) from None
        except RayActorError as exc:  # shutdown (engines stop before the ingress) or a failed replica
            finished = True  # its actor is gone: nothing to cancel
            logger.warning("request %s: its engine replica stopped: %s", request.request_id, exc)
            raise BackendUnavailable("the engine replica serving this request stopped (the server is shutting "
                                     "down or the replica failed); retry later",
                                     retry_after_s=self.retry_after_s) from None
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:  # the consumer left early: cancelling aborts it on the replica
                _cancel(response, request.request_id)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """For other Ray apps: `serve.get_app_handle("ponytail").options(stream=True).generate.remote(req)`
        yields the same deltas the HTTP stream is made of."""
        if request.request_id is None:
            request.request_id = f"handle-{uuid.uuid4().hex}"
        async for delta in self.stream(request):
            yield delta

    async def abort(self, request_id: str) -> None:
        """Cancelling the stream cancels the replica's generator, which aborts the request there."""
        response = self._streams.pop(request_id, None)
        if response is not None:
            _cancel(response, request_id)


def _cancel(response, request_id: str) -> None:
    """Cancel a handle call; never raise. Serve's cancel() fetches the routing result when its
    router runs in another loop, and a call refused or failed there raises that error again."""
    try:
        response.cancel()
    except Exception as exc:  # the call had already failed: nothing runs on a replica
        logger.debug("cancelling request %s: it had already failed (%r)", request_id, exc)


def _wants_gpu(device: str) -> bool:
    if device == "cpu":
        return False
    if device == "cuda":
        return True
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def engine_arguments(settings: AppArgs, gpu: bool) -> dict:
    """EngineReplica's constructor arguments from the app's args."""
    values = asdict(settings)
    arguments = {**{name: values[name] for name in AppArgs.ENGINE_FIELDS}, "device": "cuda" if gpu else "cpu"}
    if not gpu:
        arguments["gpu_memory_utilization"] = None  # a CPU replica has no GPU to take a share of
    return arguments


def router_arguments(settings: AppArgs) -> dict:
    """request_router_kwargs for the chosen router (Serve's own takes none)."""
    return {"max_hold_s": float(settings.max_hold_s)} if settings.router == "kv_blocks" else {}


def build(args: dict | None = None):
    """The application for `serve run deployments/app.yaml` (or `serve.run(build({...}))`)."""
    settings = AppArgs(**(args or {}))
    gpu = _wants_gpu(settings.device)
    engine = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        ray_actor_options={"num_gpus": (settings.gpu_memory_utilization or 1) if gpu else 0, "num_cpus": 1},
        autoscaling_config=AutoscalingConfig(min_replicas=settings.min_replicas,
                                             max_replicas=settings.max_replicas,
                                             target_ongoing_requests=settings.target_ongoing_requests,
                                             upscale_delay_s=2, downscale_delay_s=10),
        max_ongoing_requests=settings.replica_max_ongoing_requests,
        graceful_shutdown_timeout_s=settings.shutdown_timeout_s,
        max_queued_requests=settings.max_queued_requests,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[settings.router],
                                                  request_routing_stats_period_s=settings.stats_period_s,
                                                  request_routing_stats_timeout_s=settings.stats_period_s,
                                                  request_router_kwargs=router_arguments(settings)),
    )
    engine_args = engine_arguments(settings, gpu)
    # Serve's default of 5 ongoing requests per replica would cap the whole app at 5 streams (each
    # holds its slot while it streams). The ingress takes more than the engines can run and queue,
    # so overload meets the engines' bound and gets the API's 503 (a refusal frees its slot at
    # once); its own queue is bounded too, as a backstop (Serve's plain 503, same Retry-After).
    engines = settings.max_replicas * settings.replica_max_ongoing_requests
    ingress = OpenAIIngress.options(max_ongoing_requests=engines + 2 * settings.max_queued_requests,
                                    max_queued_requests=engines + 4 * settings.max_queued_requests,
                                    backpressure_config=BackpressureConfig(retry_after_s=settings.retry_after_s),
                                    graceful_shutdown_timeout_s=settings.shutdown_timeout_s + INGRESS_SHUTDOWN_EXTRA_S)
    return ingress.bind(engine.bind(**engine_args), retry_after_s=settings.retry_after_s, limits=settings.limits(),
                        access=settings.access())
