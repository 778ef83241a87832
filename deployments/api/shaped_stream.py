"""A chat chunk stream written as another API's event stream (the Responses API's, Anthropic's)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any


async def shaped_events(feed: Callable[[Any], list[dict]], chunks: AsyncIterator) -> AsyncIterator[dict[str, Any]]:
    """`feed(item)`'s events for each item of `chunks` (generate.py's events: chat chunks, then an
    APIError if one happened, then DONE). Closed early (the client left), it closes `chunks`, whose
    own cleanup aborts the request."""
    try:
        async for item in chunks:
            for event in feed(item):
                yield event
    finally:
        await chunks.aclose()
