"""The Ponytail Serve application: `serve run deployments/app.yaml` imports `build` from here.

Two deployments: `EngineReplica` (one engine per replica, one GPU each on GPU clusters, the CPU
elsewhere), placed by the KV-block router; `OpenAIIngress` (FastAPI, the OpenAI-compatible API)
streaming from them through a handle. Other Ray apps call `generate` on the app handle directly.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, BackpressureConfig, RequestRouterConfig
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from .args import ROUTERS, AppArgs
from .engine_api import EngineAPI
from .http_guard import AccessPolicy
from .limits import RequestLimits
from .openai_api import BackendUnavailable, build_app
from .protocol import GenerateDelta, GenerateRequest, ModelInfo
from .replica import EngineReplica
from .router import hold_log

logger = logging.getLogger("ponytail.serve")

INGRESS_SHUTDOWN_EXTRA_S = 10.0  # the ingress's graceful shutdown outlasts the engines' by this much
# The ingress only awaits the engines (a slot costs a coroutine), so it takes at least this many
# requests at once: with small engine bounds, the proxy's view of the ingress's load lags on a busy
# host and its backstop queue (plain-text 503) filled before the engines' JSON 503 could answer.
INGRESS_MIN_ONGOING_REQUESTS = 1024
API_ROUTE_ROOM = 64  # requests beyond its streams an engine replica serving the API takes (health, models, metrics)


@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress:
    """HTTP front: the OpenAI API (openai_api.build_app) over the engine replicas."""

    def __init__(self, engine_handle: DeploymentHandle, retry_after_s: float = 1.0, limits: RequestLimits | None = None,
                 access: AccessPolicy | None = None):
        self.engine_handle = engine_handle  # to the EngineReplica deployment (its router picks the replica)
        self.retry_after_s = retry_after_s  # the Retry-After of a 503 when the engines' queue is full
        self.limits = limits or RequestLimits()
        self.access = access or AccessPolicy(max_body_bytes=self.limits.max_body_bytes)
        self._streams: dict[str, Any] = {}

    def __serve_build_asgi_app__(self):
        return build_app(self, self.limits, self.access, request_id_header=False)  # Serve's proxy adds x-request-id

    async def model_info(self) -> ModelInfo:
        try:
            return await self.engine_handle.model_info.remote()
        except BackPressureError as exc:  # the engines' queue bounds this call too
            raise BackendUnavailable(f"all engine replicas are busy ({exc}); retry later",
                                     retry_after_s=self.retry_after_s) from None

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        response = self.engine_handle.options(stream=True).generate.remote(request)
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

    async def engine_stats(self) -> dict:
        """For /metrics: the report of the replica this call reaches (Serve picks one per call)."""
        report = await self.engine_handle.report.remote()
        return {report.replica: report.stats}

    async def take_router_holds(self) -> list:
        """The requests this ingress's router held for want of room since the last call
        (deployments.router.HOLDS, HeldRequest each): how long each waited in front of the engines,
        which Serve's metrics do not show."""
        holds = hold_log()  # called here: Serve ships this class by value, with copies of module globals
        held = []
        while holds:  # the router may run in a thread of its own: popleft and append are atomic
            held.append(holds.popleft())
        return held

    async def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None,
                       options: dict | None = None) -> list[int]:
        return await self.engine_handle.tokenize.remote(prompt, messages, options)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self.engine_handle.detokenize.remote(token_ids)

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
    arguments = {**{name: getattr(settings, name) for name in AppArgs.ENGINE_FIELDS},
                 "model_id": settings.served_model_name, "model_alias": settings.served_name(),
                 "device": "cuda" if gpu else "cpu"}  # unnamed: served as where its tokenizer loads from
    if not gpu:
        arguments["gpu_memory_utilization"] = None  # a CPU replica has no GPU to take a share of
    return arguments


def engine_cpus(settings: AppArgs, gpu: bool) -> int:
    """CPUs an engine replica asks Ray for: its own, and its engine process's (engine_process,
    unset: on GPUs), which runs the step loop on a core of its own."""
    in_child = settings.engine_process if settings.engine_process is not None else gpu
    return 2 if in_child else 1


def router_arguments(settings: AppArgs) -> dict:
    """request_router_kwargs for the chosen router (Serve's own takes none)."""
    blocks = {"max_hold_s": float(settings.max_hold_s), "admission": settings.router_admission}
    if settings.router == "prefix":  # tokenizes chat and text prompts with the engine's tokenizer
        return {**blocks, "prefix_weight": float(settings.prefix_weight), "model": settings.model,
                "revision": settings.revision, "trust_remote_code": settings.trust_remote_code,
                "chat_template": settings.chat_template,
                "default_chat_template_kwargs": settings.default_chat_template_kwargs}
    return blocks if settings.router == "kv_blocks" else {}


def build(args: AppArgs | dict | None = None):
    """The application for `serve run deployments/app.yaml`, `serve run deployments.app:build
    key=value ...`, `ponytail serve` or `serve.run(build({...}))`. Serve validates the args into
    AppArgs itself only when the annotation is a class, not this module's postponed string."""
    settings = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    gpu = _wants_gpu(settings.device)
    settings = settings.for_device(gpu)
    in_engines = settings.serves_api_in_engines
    engine_deployment = serve.deployment(
        EngineAPI if in_engines else EngineReplica,
        name="EngineReplica",
        ray_actor_options={"num_gpus": settings.replica_num_gpus if gpu else 0,
                           "num_cpus": engine_cpus(settings, gpu)},
        autoscaling_config=AutoscalingConfig(min_replicas=settings.min_replicas,
                                             max_replicas=settings.max_replicas,
                                             target_ongoing_requests=settings.target_ongoing_requests,
                                             upscale_delay_s=2, downscale_delay_s=10),
        max_ongoing_requests=settings.replica_max_ongoing_requests,
        graceful_shutdown_timeout_s=settings.shutdown_timeout_s,
        max_queued_requests=settings.max_queued_requests,
        backpressure_config=BackpressureConfig(retry_after_s=settings.retry_after_s),
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[settings.router],
                                                  request_routing_stats_period_s=settings.stats_period_s,
                                                  request_routing_stats_timeout_s=settings.stats_period_s,
                                                  request_router_kwargs=router_arguments(settings)),
    )
    engine_args = engine_arguments(settings, gpu)
    if in_engines:  # the proxy reaches the engine replicas directly; its router places by free blocks
        # Streams are bounded in the replica (StreamGate: its own 503 in OpenAI's shape); Serve's
        # bound on all its requests leaves room for /health, /v1/models and /metrics beside them,
        # and its queue (requests count as queued until a replica takes them, so a burst fills it
        # at once) is a backstop as the ingress's is (Serve's plain 503, same Retry-After).
        streams, waiting = settings.replica_max_ongoing_requests, settings.max_queued_requests
        ongoing = streams + waiting + API_ROUTE_ROOM
        engine_deployment = engine_deployment.options(max_ongoing_requests=ongoing,
                                                      max_queued_requests=2 * settings.max_replicas * ongoing)
        return engine_deployment.bind(**engine_args, limits=settings.limits(), access=settings.access(),
                                      max_streams=streams, max_waiting=waiting, retry_after_s=settings.retry_after_s)
    # Serve's default of 5 ongoing requests per replica would cap the whole app at 5 streams (each
    # holds its slot while it streams). The ingress takes more than the engines can run and queue,
    # so overload meets the engines' bound and gets the API's 503 (a refusal frees its slot at
    # once); its own queue is bounded too, as a backstop (Serve's plain 503, same Retry-After).
    engines = settings.max_replicas * settings.replica_max_ongoing_requests
    ingress_ongoing = max(engines + 2 * settings.max_queued_requests, INGRESS_MIN_ONGOING_REQUESTS)
    ingress = OpenAIIngress.options(num_replicas=settings.ingress_replicas, max_ongoing_requests=ingress_ongoing,
                                    max_queued_requests=2 * ingress_ongoing,
                                    backpressure_config=BackpressureConfig(retry_after_s=settings.retry_after_s),
                                    graceful_shutdown_timeout_s=settings.shutdown_timeout_s + INGRESS_SHUTDOWN_EXTRA_S)
    return ingress.bind(engine_deployment.bind(**engine_args), retry_after_s=settings.retry_after_s, limits=settings.limits(),
                        access=settings.access())
