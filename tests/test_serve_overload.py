"""Overload and access through real Ray Serve (CPU): past the bounds on waiting work the API answers
503 with Retry-After in OpenAI's shape, never 500, and /health still answers; the API key guards
every /v1 route. Both shapes of the app: the engine replicas serving the API (the default; each
bounds its streams itself) and a separate ingress (the engines' Serve bound, refused there)."""

import concurrent.futures
import json
import threading

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover - older openai clients use httpx
    import httpx

from serve_support import MODEL, replica_stats, running_app  # noqa: E402

pytestmark = pytest.mark.network  # the default model

KEY = "sk-serve-test"


@pytest.fixture(scope="module", params=[True, False], ids=["api_in_engines", "separate_ingress"])
def app(default_model, request):
    # One replica running at most 2 requests at a time, 2 more may wait for it: the rest are refused.
    with running_app(min_replicas=1, max_replicas=1, max_num_seqs=2, max_ongoing_requests=2, max_queued_requests=2,
                     retry_after_s=2, api_key=KEY, api_in_engines=request.param) as (_, port):
        yield f"http://127.0.0.1:{port}", request.param


def post(url, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=180)


def stream_completion_tokens(url: str, body: dict, started: threading.Event) -> int:
    """Streams a completion, sets `started` at its first event (the engine is running it: a report
    call could not say so, since it would wait for one of the replica's taken slots), returns its
    completion tokens."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=180) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            started.set()
            if line.startswith("data: {"):
                usage = json.loads(line[len("data: "):]).get("usage") or usage
    return usage["completion_tokens"]


def test_overload_is_a_503_with_retry_after_never_a_500(app):
    app, in_engines = app
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 48, "temperature": 0.8, "ignore_eos": True}
    long_body = {**body, "max_tokens": 160}
    # Two requests fill the replica before the burst. Ray counts a request as queued until a replica
    # takes it, so a burst into an idle app could see 12 queued at once and keep only 2 (Ray's router
    # says as much); with both slots taken first, the burst's 2 queued are served and the rest refused.
    with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
        started = [threading.Event() for _ in range(2)]
        first = [pool.submit(stream_completion_tokens, app, long_body, event) for event in started]
        assert all(event.wait(120) for event in started), [f.exception() for f in first if f.done()]
        burst = [pool.submit(post, app, body) for _ in range(10)]
        next(concurrent.futures.as_completed(burst))  # a refusal: the slots are full, two wait
        health = httpx.get(f"{app}/health", timeout=30)  # answered beside full streams, not queued behind them
        responses = [f.result() for f in burst]
        assert [f.result() for f in first] == [160, 160]
    assert health.status_code == 200
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 503}, [r.text for r in responses if r.status_code == 500]
    assert statuses.count(200) >= 2 and statuses.count(503) >= 1, statuses
    for r in responses:
        if r.status_code == 503:
            error = r.json()["error"]
            assert error["type"] == "service_unavailable_error" and error["code"] == "service_unavailable"
            if in_engines:  # the replica's own bound (deployments/stream_gate.py)
                assert error["message"] == ("all engine replicas are busy (this replica: 2 streams running, "
                                            "max_ongoing_requests=2; 2 waiting, max_queued_requests=2); retry later")
            else:
                assert error["message"].startswith("all engine replicas are busy (Request dropped due to "
                                                   "backpressure (num_queued_requests=2, max_queued_requests=2).); "
                                                   "retry later")
            assert r.headers["retry-after"] == "2"
        else:
            assert r.json()["usage"]["completion_tokens"] == 48
    # Served again once the burst is over, and nothing was left holding blocks.
    assert post(app, {**body, "max_tokens": 2}).status_code == 200
    assert all(stats.used_blocks == 0 for stats in replica_stats(replicas=1).values())


def test_streams_past_the_bound_get_a_503_before_any_event(app):
    app, _ = app
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 32, "stream": True}
    extra = {"extra_body": {"ignore_eos": True}}
    with openai.OpenAI(base_url=f"{app}/v1", api_key=KEY, max_retries=0, timeout=180) as client:
        def run(_):
            try:
                return sum(1 for chunk in client.completions.create(**body, **extra) if chunk.choices and chunk.choices[0].text)
            except openai.APIStatusError as exc:
                return exc.status_code

        with concurrent.futures.ThreadPoolExecutor(max_workers=10) as pool:
            results = list(pool.map(run, range(10)))
    refused = [r for r in results if r == 503]
    assert refused and all(r == 503 or 0 < r <= 32 for r in results), results


def test_the_api_key_is_checked_through_serve(app):
    app, _ = app
    r = post(app, {"prompt": "hi", "max_tokens": 1}, key=None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = post(app, {"prompt": "hi", "max_tokens": 1}, key="sk-wrong")
    assert r.status_code == 401
    assert httpx.get(f"{app}/health", timeout=30).status_code == 200
    r = httpx.post(f"{app}/v1/completions", content=b"{}", headers={"Authorization": f"Bearer {KEY}",
                                                                     "Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 415
