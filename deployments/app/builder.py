"""The Ponytail Serve application: `serve run deployments/app.yaml` imports `build` (deployments.app).

The engine replicas (one engine each, one GPU each on GPU clusters, the CPU elsewhere), placed by
the KV-block router, serve the OpenAI API themselves (engine_api.py); with the prefix router or
several ingress replicas a separate ingress deployment (ingress.py) serves it through a handle.
Other Ray apps call `generate` on the app handle directly.
"""

from __future__ import annotations

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, BackpressureConfig, RequestRouterConfig

from .args import ROUTERS, AppArgs
from .engine_api import EngineAPI
from .ingress import OpenAIIngress
from .replica import EngineReplica

INGRESS_SHUTDOWN_EXTRA_S = 10.0  # the ingress's graceful shutdown outlasts the engines' by this much
# The ingress only awaits the engines (a slot costs a coroutine), so it takes at least this many
# requests at once: with small engine bounds, the proxy's view of the ingress's load lags on a busy
# host and its backstop queue (plain-text 503) filled before the engines' JSON 503 could answer.
INGRESS_MIN_ONGOING_REQUESTS = 1024
API_ROUTE_ROOM = 64  # requests beyond its streams an engine replica serving the API takes (health, models, metrics)


def wants_gpu(settings: AppArgs) -> bool:
    """Whether the engine replicas take GPUs: the engine's device, or with "auto" whether the cluster has any."""
    device = settings.engine.get("device", "auto")
    if device == "cpu":
        return False
    if device.startswith("cuda"):
        return True
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def engine_arguments(settings: AppArgs, gpu: bool) -> dict:
    """EngineReplica's constructor arguments from the app's args: the model, the engine's arguments
    and the replica's options; unnamed, the model is served as where its tokenizer loads from, and
    by its short name."""
    return {"model": settings.model, "engine": settings.engine_on(gpu), "model_alias": settings.served_name(),
            **settings.replica_options()}


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
                "revision": settings.engine.get("revision"),
                "trust_remote_code": settings.engine.get("trust_remote_code", False),
                "chat_template": settings.chat_template,
                "default_chat_template_kwargs": settings.default_chat_template_kwargs}
    return blocks if settings.router == "kv_blocks" else {}


def build(args: AppArgs | dict | None = None):
    """The application for `serve run deployments/app.yaml`, `serve run deployments.app:build
    key=value ...`, `ponytail serve` or `serve.run(build({...}))`. Serve validates the args into
    AppArgs itself only when the annotation is a class, not this module's postponed string."""
    settings = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    gpu = wants_gpu(settings)
    replica_ongoing = settings.replica_max_ongoing_requests(gpu)
    in_engines = settings.serves_api_in_engines
    engine_deployment = serve.deployment(
        EngineAPI if in_engines else EngineReplica,
        name="EngineReplica",
        ray_actor_options={"num_gpus": settings.replica_num_gpus if gpu else 0,
                           "num_cpus": engine_cpus(settings, gpu)},
        autoscaling_config=AutoscalingConfig(min_replicas=settings.min_replicas,
                                             max_replicas=settings.max_replicas,
                                             target_ongoing_requests=settings.target_ongoing(gpu),
                                             upscale_delay_s=2, downscale_delay_s=10),
        max_ongoing_requests=replica_ongoing,
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
        streams, waiting = replica_ongoing, settings.max_queued_requests
        ongoing = streams + waiting + API_ROUTE_ROOM
        engine_deployment = engine_deployment.options(max_ongoing_requests=ongoing,
                                                      max_queued_requests=2 * settings.max_replicas * ongoing)
        return engine_deployment.bind(**engine_args, limits=settings.limits(), access=settings.access(),
                                      max_streams=streams, max_waiting=waiting, retry_after_s=settings.retry_after_s)
    # Serve's default of 5 ongoing requests per replica would cap the whole app at 5 streams (each
    # holds its slot while it streams). The ingress takes more than the engines can run and queue,
    # so overload meets the engines' bound and gets the API's 503 (a refusal frees its slot at
    # once); its own queue is bounded too, as a backstop (Serve's plain 503, same Retry-After).
    engines = settings.max_replicas * replica_ongoing
    ingress_ongoing = max(engines + 2 * settings.max_queued_requests, INGRESS_MIN_ONGOING_REQUESTS)
    ingress = OpenAIIngress.options(num_replicas=settings.ingress_replicas, max_ongoing_requests=ingress_ongoing,
                                    max_queued_requests=2 * ingress_ongoing,
                                    backpressure_config=BackpressureConfig(retry_after_s=settings.retry_after_s),
                                    graceful_shutdown_timeout_s=settings.shutdown_timeout_s + INGRESS_SHUTDOWN_EXTRA_S)
    return ingress.bind(engine_deployment.bind(**engine_args), retry_after_s=settings.retry_after_s,
                        limits=settings.limits(), access=settings.access())
