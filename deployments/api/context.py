"""What every route of one API app shares: the backend, the limits, and the served model's info,
asked once."""

from __future__ import annotations

import asyncio
import time

from .api_metrics import ApiMetrics
from .limits import RequestLimits
from .protocol import ModelInfo
from .streams import Backend


class ApiContext:
    def __init__(self, backend: Backend, limits: RequestLimits, request_id_header: bool = True):
        self.backend = backend
        self.limits = limits
        self.request_id_header = request_id_header  # False behind Serve, whose proxy sets x-request-id
        self._info: ModelInfo | None = None  # a deployment serves one model for its whole life
        self._asking: asyncio.Future | None = None  # the one backend.model_info call in flight
        self._metrics: ApiMetrics | None = None  # made with the first model_info: it labels the series
        self.created = int(time.time())

    async def model_info(self) -> ModelInfo:
        """The backend's answer, asked once: a burst of first requests shares one call."""
        if self._info is None:
            if self._asking is None or self._asking.done():
                self._asking = asyncio.ensure_future(self.backend.model_info())
            self._info = await asyncio.shield(self._asking)
        return self._info

    def metrics(self, info: ModelInfo) -> ApiMetrics:
        if self._metrics is None:
            # Labelled with the short name when the served one is a path: stable across machines.
            self._metrics = ApiMetrics(info.aliases[0] if info.aliases else info.model_id)
        return self._metrics
