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
from .stream_gate import StreamGate


class ReplicaBackend:
    """openai_api's Backend over an EngineReplica in this process (what the separate ingress does
    through a handle); with a gate, its streams are bounded there (stream_gate.py)."""

    def __init__(self, replica: EngineReplica, gate: StreamGate | None = None):
        self.replica = replica
        self.gate = gate

    async def model_info(self):
        return await self.replica.model_info()

    def stream(self, request):
        if self.gate is None:
            return self.replica.generate(request)
        return self.gate.stream(self.replica.generate, request)

    async def abort(self, request_id: str) -> None:
        await self.replica.abort(request_id)

    async def engine_stats(self):
        # ray.get_runtime_context() would start a Ray cluster in a process without one
        actor = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
        return {actor or "local": self.replica.llm.stats()}

    async def tokenize(self, prompt, messages, options=None):
        return await self.replica.tokenize(prompt, messages, options)

    async def detokenize(self, token_ids):
        return await self.replica.detokenize(token_ids)


@serve.ingress()
class EngineAPI(EngineReplica):
    """An engine replica that also serves the OpenAI API over HTTP (its handle methods stay).
    max_streams HTTP streams run at once and max_waiting more wait (StreamGate); the deployment's
    Serve bounds leave room above that for the API's other routes."""

    def __init__(self, limits: RequestLimits | None = None, access: AccessPolicy | None = None,
                 max_streams: int = 128, max_waiting: int = 256, retry_after_s: float = 1.0, **engine_args):
        super().__init__(**engine_args)
        self.limits = limits or RequestLimits()
        self.access = access or AccessPolicy(max_body_bytes=self.limits.max_body_bytes)
        self.gate = StreamGate(max_streams, max_waiting, retry_after_s)

    def __serve_build_asgi_app__(self):
        return build_app(ReplicaBackend(self, self.gate), self.limits, self.access, request_id_header=False)
