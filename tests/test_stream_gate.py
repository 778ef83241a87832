"""StreamGate (deployments/stream_gate.py): an engine replica serving the API bounds its streams
itself: `limit` run, `max_waiting` wait, the rest get BackendUnavailable (503 with Retry-After);
a stream that ends, fails or is cancelled, waiting or running, gives its place back."""

import asyncio

import pytest

from deployments.api.errors import BackendUnavailable
from deployments.api.stream_gate import StreamGate


def deltas_until(release: asyncio.Event, fail: bool = False):
    async def deltas_of(request):
        yield f"{request}:first"
        await release.wait()
        if fail:
            raise RuntimeError("engine failed")
        yield f"{request}:last"
    return deltas_of


async def collect(stream) -> list[str]:
    return [item async for item in stream]


def test_limit_run_max_waiting_wait_and_the_rest_are_refused_naming_both_bounds():
    async def main():
        gate = StreamGate(limit=1, max_waiting=1, retry_after_s=3)
        release = asyncio.Event()
        running = asyncio.create_task(collect(gate.stream(deltas_until(release), "a")))
        waiting = asyncio.create_task(collect(gate.stream(deltas_until(release), "b")))
        await asyncio.sleep(0.01)
        assert (gate.running, gate.waiting) == (1, 1)
        with pytest.raises(BackendUnavailable) as refused:
            await collect(gate.stream(deltas_until(release), "c"))
        assert str(refused.value) == ("all engine replicas are busy (this replica: 1 streams running, "
                                      "max_ongoing_requests=1; 1 waiting, max_queued_requests=1); retry later")
        assert refused.value.retry_after_s == 3
        release.set()
        assert await running == ["a:first", "a:last"] and await waiting == ["b:first", "b:last"]
        assert (gate.running, gate.waiting) == (0, 0)
        assert await collect(gate.stream(deltas_until(release), "d")) == ["d:first", "d:last"]

    asyncio.run(main())


def test_cancelled_and_failed_streams_give_their_places_back():
    async def main():
        gate = StreamGate(limit=1, max_waiting=1, retry_after_s=1)
        release = asyncio.Event()
        running = asyncio.create_task(collect(gate.stream(deltas_until(release, fail=True), "a")))
        waiting = asyncio.create_task(collect(gate.stream(deltas_until(release), "b")))
        await asyncio.sleep(0.01)
        waiting.cancel()  # the client left while it waited
        await asyncio.gather(waiting, return_exceptions=True)
        assert (gate.running, gate.waiting) == (1, 0)
        release.set()
        with pytest.raises(RuntimeError, match="engine failed"):
            await running
        assert (gate.running, gate.waiting) == (0, 0)
        stream = gate.stream(deltas_until(asyncio.Event()), "c")
        assert await anext(stream) == "c:first"
        await stream.aclose()  # closed mid-stream (a client disconnect): the slot comes back
        assert gate.running == 0
        assert await collect(gate.stream(deltas_until(release), "d")) == ["d:first", "d:last"]

    asyncio.run(main())
