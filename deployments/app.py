"""The Ponytail Serve application: `serve run deployments/app.yaml` imports `build` from here.

Two deployments: `EngineReplica` (one engine per replica, one GPU each on GPU clusters, the CPU
elsewhere), placed by the KV-block router; `OpenAIIngress` (FastAPI, the OpenAI-compatible API)
streaming from them through a handle. Other Ray apps call `generate` on the app handle directly.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from .args import ROUTERS, AppArgs
from .openai_api import BackendUnavailable, build_app
from .protocol import GenerateDelta, GenerateRequest, ModelInfo
from .replica import EngineReplica

@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress:
    """HTTP front: the OpenAI API (openai_api.build_app) over the engine replicas."""

    def __init__(self, engine: DeploymentHandle):
        self.engine = engine
        self._streams: dict[str, Any] = {}

    def __serve_build_asgi_app__(self):
        return build_app(self)

    async def model_info(self) -> ModelInfo:
        return await self.engine.model_info.remote()

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        response = self.engine.options(stream=True).generate.remote(request)
        self._streams[request.request_id] = response
        finished = False
        try:
            async for delta in response:
                finished = delta.finished
                yield delta
        except BackPressureError as exc:
            raise BackendUnavailable(f"all engine replicas are busy: {exc}") from exc
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:  # the consumer left early: cancelling aborts it on the replica
                response.cancel()

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
            response.cancel()


def _wants_gpu(device: str) -> bool:
    if device == "cpu":
        return False
    if device == "cuda":
        return True
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def engine_arguments(settings: AppArgs, gpu: bool) -> dict:
    """EngineReplica's constructor arguments from the app's args."""
    return {**{name: getattr(settings, name) for name in AppArgs.ENGINE_FIELDS},
            "model_id": settings.served_name(), "device": "cuda" if gpu else "cpu"}


def router_arguments(settings: AppArgs) -> dict:
    """request_router_kwargs for the chosen router (Serve's own takes none)."""
    return {"max_hold_s": float(settings.max_hold_s)} if settings.router == "kv_blocks" else {}


def build(args: AppArgs | dict | None = None):
    """The application for `serve run deployments/app.yaml`, `serve run deployments.app:build
    key=value ...`, `ponytail serve` or `serve.run(build({...}))`. Serve validates the args into
    AppArgs itself only when the annotation is a class, not this module's postponed string."""
    settings = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    gpu = _wants_gpu(settings.device)
    engine = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        ray_actor_options={"num_gpus": 1 if gpu else 0, "num_cpus": 1},
        autoscaling_config=AutoscalingConfig(min_replicas=settings.min_replicas,
                                             max_replicas=settings.max_replicas,
                                             target_ongoing_requests=settings.target_ongoing_requests,
                                             upscale_delay_s=2, downscale_delay_s=10),
        max_ongoing_requests=settings.max_num_seqs * 2,
        max_queued_requests=settings.max_queued_requests,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[settings.router],
                                                  request_routing_stats_period_s=settings.stats_period_s,
                                                  request_routing_stats_timeout_s=settings.stats_period_s,
                                                  request_router_kwargs=router_arguments(settings)),
    )
    engine_args = engine_arguments(settings, gpu)
    # Serve's default of 5 ongoing requests per replica would cap the whole app at 5 streams (each
    # holds its slot while it streams): let the ingress take what the engines can run and queue.
    ingress = OpenAIIngress.options(max_ongoing_requests=settings.max_replicas * settings.max_num_seqs * 2
                                    + settings.max_queued_requests)
    return ingress.bind(engine.bind(**engine_args))
