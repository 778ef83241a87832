"""The HTTP API over any backend that streams GenerateDeltas: request and response shapes, tools,
reasoning, limits, errors, server-sent events. No Ray in here.

Imports: ponytail's public names, fastapi, starlette, pydantic, prometheus_client; never deployments.app.
"""

from .errors import BackendUnavailable
from .protocol import GenerateDelta, GenerateRequest, ModelInfo
from .server import build_app
from .streams import Backend

__all__ = ["Backend", "BackendUnavailable", "GenerateDelta", "GenerateRequest", "ModelInfo", "build_app"]
