"""The OpenAI API served by the engine replicas themselves (app arg `api_in_engines`).

With a separate ingress deployment every streamed delta crosses two Ray hops (engine replica ->
ingress -> proxy), each a Python process that handles one message per delta. Here the proxy (or,
in Ray's throughput-optimized mode, HAProxy) reaches the engine replica directly: its process
formats the server-sent events next to the engine's front, as vLLM's API server sits next to its
engine core, and Serve batches the ASGI messages of each stream toward the proxy.
"""

from __future__ import annotations

from ray import serve

from deployments.api.http_guard import AccessPolicy
from deployments.api.limits import RequestLimits
from deployments.api.server import build_app
from deployments.api.stream_gate import StreamGate

from .replica import EngineReplica


@serve.ingress()
class EngineAPI(EngineReplica):
    """An engine replica that also serves the OpenAI API over HTTP, as its own backend (its handle
    methods stay). max_streams HTTP streams run at once and max_waiting more wait (StreamGate); the
    deployment's Serve bounds leave room above that for the API's other routes."""

    def __init__(self, *args, limits: RequestLimits | None = None, access: AccessPolicy | None = None,
                 max_streams: int = 128, max_waiting: int = 256, retry_after_s: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits or RequestLimits()
        self.access = access or AccessPolicy(max_body_bytes=self.limits.max_body_bytes)
        self.gate = StreamGate(max_streams, max_waiting, retry_after_s)

    def __serve_build_asgi_app__(self):
        return build_app(self, self.limits, self.access, request_id_header=False)
