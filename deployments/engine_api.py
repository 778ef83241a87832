"""The OpenAI API served by the engine replicas themselves (app arg `api_in_engines`).

With a separate ingress deployment every streamed delta crosses two Ray hops (engine replica ->
ingress -> proxy), each a Python process that handles one message per delta. Here the proxy (or,
in Ray's throughput-optimized mode, HAProxy) reaches the engine replica directly: its process
formats the server-sent events next to the engine's front, as vLLM's API server sits next to its
engine core, and Serve batches the ASGI messages of each stream toward the proxy.
"""

from __future__ import annotations

import ray
from ray import serve

from .http_guard import AccessPolicy
from .limits import RequestLimits
from .openai_api import build_app
from .replica import EngineReplica


class ReplicaBackend:
    """openai_api's Backend over an EngineReplica in this process (what the separate ingress does
    through a handle)."""

    def __init__(self, replica: EngineReplica):
        self.replica = replica

    async def model_info(self):
        return await self.replica.model_info()

    def stream(self, request):
        return self.replica.generate(request)

    async def abort(self, request_id: str) -> None:
        await self.replica.abort(request_id)

    async def engine_stats(self):
        # ray.get_runtime_context() would start a Ray cluster in a process without one
        actor = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
        return {actor or "local": self.replica.llm.stats()}

    async def tokenize(self, prompt, messages):
        return await self.replica.tokenize(prompt, messages)

    async def detokenize(self, token_ids):
        return await self.replica.detokenize(token_ids)


@serve.ingress()
class EngineAPI(EngineReplica):
    """An engine replica that also serves the OpenAI API over HTTP (its handle methods stay)."""

    def __init__(self, limits: RequestLimits | None = None, access: AccessPolicy | None = None, **engine_args):
        super().__init__(**engine_args)
        self.limits = limits or RequestLimits()
        self.access = access or AccessPolicy(max_body_bytes=self.limits.max_body_bytes)

    def __serve_build_asgi_app__(self):
        return build_app(ReplicaBackend(self), self.limits, self.access, request_id_header=False)
