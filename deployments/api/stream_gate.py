"""A replica's bound on the generate streams it runs, for the API on the engine replicas.

Serve bounds a replica's requests with max_ongoing_requests and queues the rest in the proxy;
every HTTP request counts, so with generate streams filling the bound a `/health` or `/v1/models`
call would wait behind them. The engine deployment gets Serve bounds with room to spare, and this
gate bounds the streams alone: `limit` run at once, `max_waiting` more wait for a slot, and past
that the API answers 503 in OpenAI's shape with Retry-After, as the separate ingress does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from .errors import BackendUnavailable


class StreamGate:
    def __init__(self, limit: int, max_waiting: int, retry_after_s: float):
        self.limit, self.max_waiting, self.retry_after_s = limit, max_waiting, retry_after_s
        self._slots = asyncio.Semaphore(limit)
        self.running = 0
        self.waiting = 0

    async def stream(self, deltas_of, request) -> AsyncIterator:
        """deltas_of(request)'s items once a slot is free; BackendUnavailable when too many wait."""
        if self._slots.locked() and self.waiting >= self.max_waiting:
            raise BackendUnavailable(f"all engine replicas are busy (this replica: {self.running} streams running, "
                                     f"max_ongoing_requests={self.limit}; {self.waiting} waiting, "
                                     f"max_queued_requests={self.max_waiting}); retry later",
                                     retry_after_s=self.retry_after_s)
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            async for delta in deltas_of(request):
                yield delta
        finally:
            self.running -= 1
            self._slots.release()
