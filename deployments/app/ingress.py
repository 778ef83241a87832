"""The separate ingress deployment: the OpenAI API (FastAPI) over the engine replicas, through a
Serve handle whose router places each request (api_in_engines off, the prefix router, or more than
one ingress replica). Other Ray apps may call its `generate` too."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from deployments.api.cut_streams import REPLICA_STOPPED
from deployments.api.errors import BackendUnavailable
from deployments.api.http_guard import AccessPolicy
from deployments.api.limits import RequestLimits
from deployments.api.protocol import GenerateDelta, GenerateRequest, ModelInfo
from deployments.api.server import build_app

from .router_accounting import hold_log

logger = logging.getLogger("ponytail.serve")


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
            raise BackendUnavailable(REPLICA_STOPPED, retry_after_s=self.retry_after_s) from None
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
