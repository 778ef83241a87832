"""Soak test: minutes of mixed load against the running app, loopback only.

Workers loop until the deadline, each iteration one of (weights in MIX):
  ok          a short completion or chat, streamed or not, maybe with one
              of vLLM's extras (EXTRAS; prompt_logprobs or use_beam_search
              when not streamed)                                           -> 200
  disconnect  a long stream the client drops after a few events            -> 200, then gone
  bad         a hostile or malformed request (BAD_INPUTS)                  -> its declared 4xx
  burst       BURST requests at once, past the engines' queue bound        -> 200 or a declared 503
With --kill-every-s, a fault thread also kills an engine replica (kill -9 of its process) that
often; Serve replaces it. A declared 503 is OpenAI-shaped with code service_unavailable and a
Retry-After header; any other 5xx is a failure, as is a bad input answered with another status.
Every stream must end with its last chunk and [DONE], or with the error event then [DONE]: one that
stops otherwise (a broken read, no [DONE]) is a silent truncation, as is a dropped connection. After
the load the script waits for the engines to go idle and reads every replica's KV blocks in use
(must be 0) and resident memory (before and after). Exit status 1 if anything failed.

    python benchmarks/soak.py --start --duration-s 300          # starts Ray + the app (CPU) itself
    python benchmarks/soak.py --start --duration-s 600 --kill-every-s 60 --app-args '{"min_replicas": 2, "max_replicas": 2}'
    python benchmarks/soak.py --url http://127.0.0.1:8000 --duration-s 600 --api-key $PONYTAIL_API_KEY
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    import httpx2 as httpx  # the HTTP library openai>=3 depends on
except ImportError:  # pragma: no cover
    import httpx

MODEL = "SmolLM2-135M-Instruct"
MIX = {"ok": 5, "disconnect": 2, "bad": 2, "burst": 1}
BURST = 24
LOOPBACK = ("127.0.0.1", "localhost", "::1")
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]

# (name, path, body or raw bytes, content type, expected status)
BAD_INPUTS = [
    ("role", "/v1/chat/completions", {"messages": [{"role": "hacker", "content": "hi"}]}, None, 400),
    ("null content", "/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, None, 400),
    ("temperature", "/v1/chat/completions", {"messages": CHAT, "temperature": 1e30}, None, 400),
    ("stop count", "/v1/completions", {"prompt": "hi", "stop": ["x"] * 1000}, None, 400),
    ("n", "/v1/completions", {"prompt": "hi", "n": 17}, None, 400),  # beyond max_n (16)
    ("max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, None, 400),
    ("token ids", "/v1/completions", {"prompt": [10**12]}, None, 400),
    ("model", "/v1/completions", {"prompt": "hi", "model": "x" * 100_000}, None, 404),
    ("json", "/v1/completions", b'{"prompt": ', "application/json", 400),
    ("text/plain", "/v1/completions", b'{"prompt": "hi"}', "text/plain", 415),
    ("body size", "/v1/completions", {"prompt": "a" * (5 << 20)}, None, 413),
    ("long prompt", "/v1/completions", {"prompt": "lorem ipsum " * 200_000, "max_tokens": 1}, None, 400),
    # token ids past the vocabulary: an out-of-vocabulary logit_bias id used to stop a whole engine step
    ("logit_bias id", "/v1/completions", {"prompt": "hi", "logit_bias": {"1000000": 5}}, None, 400),
    ("allowed_token_ids", "/v1/chat/completions", {"messages": CHAT, "allowed_token_ids": [10**7]}, None, 400),
    ("bad_words", "/v1/chat/completions", {"messages": CHAT, "bad_words": [""]}, None, 400),
    ("cache_salt", "/v1/completions", {"prompt": "hi", "cache_salt": ""}, None, 400),
]
# vLLM's extras an ok request may carry (one at a time): each must be served like a plain request.
EXTRAS = [{}, {"bad_words": ["the", "sea"]}, {"cache_salt": "tenant-1"}, {"cache_salt": "tenant-2"},
          {"logprobs": 2, "return_tokens_as_token_ids": True}]


@dataclass
class SoakResult:
    duration_s: float
    requests: int = 0
    served: int = 0  # 2xx
    declared_503: int = 0
    failed_explicitly: int = 0  # streams ended by the error event, then [DONE]
    silent_truncations: int = 0  # must be 0: streams that stopped without either ending, dropped connections
    unexpected_5xx: int = 0  # must be 0
    bad_input_mismatches: list[str] = field(default_factory=list)  # must be empty
    disconnects: int = 0
    replica_kills: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    leaked_blocks: int | None = None  # KV blocks still in use once idle: must be 0
    replica_rss_before: dict[str, int] = field(default_factory=dict)
    replica_rss_after: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (self.unexpected_5xx == 0 and self.silent_truncations == 0 and not self.bad_input_mismatches
                and self.leaked_blocks == 0)


class Soak:
    def __init__(self, url: str, api_key: str | None, deadline: float, seed: int):
        self.url = url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.deadline = deadline
        self.seed = seed
        self.lock = threading.Lock()
        self.statuses: Counter = Counter()
        self.declared_503 = 0
        self.unexpected: list[str] = []
        self.mismatches: list[str] = []
        self.disconnects = 0
        self.failed_explicitly = 0
        self.silent: list[str] = []

    def record(self, response, what: str) -> int:
        status = response.status_code
        if status != 200:
            response.read()  # a streamed error answer is one JSON body
        with self.lock:
            self.statuses[status] += 1
            if status == 503 and _declared_503(response):
                self.declared_503 += 1
            elif status >= 500:
                self.unexpected.append(f"{what}: {status} {response.text[:200]}")
        return status

    def worker(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        actions, weights = zip(*MIX.items())
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=120) as client:
            while time.monotonic() < self.deadline:
                action = rng.choices(actions, weights)[0]
                try:
                    getattr(self, action)(client, rng)
                except httpx.TransportError as exc:  # the connection dropped: no answer, no ending
                    with self.lock:
                        self.silent.append(f"{action}: {type(exc).__name__}: {exc}")

    def ending(self, lines: list[str], what: str, cut_short: bool = False) -> None:
        """Checks a stream's data lines: its last chunk then [DONE], or the declared error then [DONE]
        (a replica that stopped); a stream the client left early (`cut_short`) may end anywhere."""
        error = next((line for line in lines if line.startswith('data: {"error"')), None)
        with self.lock:
            if error is not None:
                if lines[-2:] == [error, "data: [DONE]"] and '"code":"service_unavailable"' in error:
                    self.failed_explicitly += 1
                else:
                    self.unexpected.append(f"{what}: an error other than a stopped replica's: {lines[-2:]}")
            elif not cut_short and (not lines or lines[-1] != "data: [DONE]"):
                self.silent.append(f"{what} ended without [DONE] or an error: {lines[-2:]}")

    def ok(self, client, rng) -> None:
        stream = rng.random() < 0.5
        extra = rng.choice(EXTRAS)
        if rng.random() < 0.5:
            body = {"model": MODEL, "prompt": "The sea is", "max_tokens": rng.randint(1, 24), "stream": stream, **extra}
            path = "/v1/completions"
        else:
            body = {"model": MODEL, "messages": CHAT, "max_tokens": rng.randint(1, 24), "stream": stream, **extra}
            if "logprobs" in extra:  # chat's logprobs are a flag with top_logprobs beside it
                body.update(logprobs=True, top_logprobs=extra["logprobs"])
            path = "/v1/chat/completions"
        if not stream and not extra and rng.random() < 0.2:
            body.update(use_beam_search=True, n=2)  # vLLM's beam search: the 2 best of 2 beams
        elif not stream and rng.random() < 0.2:
            body["prompt_logprobs"] = 1
        if not stream:
            self.record(client.post(path, json=body), "ok")
            return
        with client.stream("POST", path, json=body) as response:
            if self.record(response, "ok stream") == 200:
                self.ending([line for line in response.iter_lines() if line.startswith("data: ")], "ok stream")

    def disconnect(self, client, rng) -> None:
        body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            if self.record(response, "disconnect") == 200:
                keep, lines = rng.randint(1, 8), []
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                    if len(lines) >= keep:
                        break
                self.ending(lines, "disconnect", cut_short=len(lines) >= keep)
                with self.lock:
                    self.disconnects += 1
        # leaving the with-block closes the connection mid-stream

    def bad(self, client, rng) -> None:
        name, path, body, content_type, expected = rng.choice(BAD_INPUTS)
        if isinstance(body, bytes):
            response = client.post(path, content=body, headers={"Content-Type": content_type})
        else:
            response = client.post(path, json=body)
        status = self.record(response, f"bad input {name!r}")
        if status != expected and status != 503:  # overload may answer first; that is declared
            with self.lock:
                self.mismatches.append(f"{name}: expected {expected}, got {status} {response.text[:120]}")

    def burst(self, client, rng) -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16}
        with concurrent.futures.ThreadPoolExecutor(max_workers=BURST) as pool:
            list(pool.map(lambda _: self.record(client.post("/v1/completions", json=body), "burst"), range(BURST)))


def kill_replicas(every_s: float, deadline: float, seed: int, kills: list[str]) -> None:
    """Until the deadline, every `every_s` seconds: kill -9 the process of a running engine replica."""
    import ray

    rng = random.Random(seed)
    while time.monotonic() + every_s < deadline:
        time.sleep(every_s)
        names = sorted(_engine_reports())
        victim = ray.get_actor(rng.choice(names), namespace="serve")
        pid = ray.get(victim.__ray_call__.remote(lambda replica: os.getpid()), timeout=60)
        os.kill(pid, signal.SIGKILL)
        kills.append(f"{time.monotonic():.0f}: {pid}")
        print(f"killed an engine replica (pid {pid}) of {len(names)}", flush=True)


def _declared_503(response) -> bool:
    try:
        error = response.json()["error"]
    except Exception:
        return False
    return error.get("code") == "service_unavailable" and "retry-after" in response.headers


def _check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"--url {url!r}: soak only targets loopback ({', '.join(LOOPBACK)}); got host {host!r}")


def _engine_reports() -> dict:
    from ray import serve

    from deployments.app.reports import replica_reports

    status = serve.status().applications["ponytail"].deployments["EngineReplica"]
    return replica_reports("ponytail", replicas=max(1, status.replica_states.get("RUNNING", 0)))


def _rss(_replica) -> int:
    import psutil

    return psutil.Process().memory_info().rss


def replica_memory() -> dict[str, int]:
    """Resident bytes of each engine replica's process, by actor name (asked inside the actor);
    0 each where psutil is not installed (a bare GPU machine's bundle)."""
    import importlib.util

    import ray

    reports = _engine_reports()
    if importlib.util.find_spec("psutil") is None:
        return dict.fromkeys(reports, 0)
    return {name: ray.get(ray.get_actor(name, namespace="serve").__ray_call__.remote(_rss), timeout=60)
            for name in reports}


def leaked_blocks(replicas: int, idle_timeout_s: float = 300) -> int:
    """KV blocks in use once all `replicas` run again (killed ones replaced) and are idle (or at the timeout)."""
    deadline = time.monotonic() + idle_timeout_s
    while True:
        reports = _engine_reports()
        stats = [r.stats for r in reports.values()]
        idle = len(reports) >= replicas and all(s.num_running == 0 and s.num_waiting == 0 for s in stats)
        if idle or time.monotonic() > deadline:
            return sum(s.used_blocks for s in stats)
        time.sleep(0.5)


@contextlib.contextmanager
def started_app(args_json: str):
    """Ray + Serve + the app on 127.0.0.1 (CPU engines unless the args say otherwise); yields the URL."""
    import socket

    import ray
    from ray import serve

    from deployments.app.builder import build
    from deployments.app.stream_closer import controller_options
    from serve_args import nested

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    with socket.socket() as s:  # after Ray's own processes took their ports
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, controller_options=controller_options())
        app_args = {"device": "cpu", "kv_cache_memory": "256MiB", "max_num_seqs": 8, "max_model_len": 2048,
                    "max_queued_requests": 8, "min_replicas": 1, "max_replicas": 1, **json.loads(args_json)}
        serve.run(build(nested(app_args)), name="ponytail", route_prefix="/")
        yield f"http://127.0.0.1:{port}", app_args.get("api_key")
    finally:
        serve.shutdown()
        ray.shutdown()


def run(url: str, api_key: str | None, duration_s: float, workers: int, seed: int,
        kill_every_s: float = 0) -> SoakResult:
    import ray

    if not ray.is_initialized():
        ray.init(address="auto", log_to_driver=False)
    result = SoakResult(duration_s=duration_s)
    result.replica_rss_before = replica_memory()
    replicas = len(result.replica_rss_before)
    soak = Soak(url, api_key, time.monotonic() + duration_s, seed)
    kills: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers + 1) as pool:
        futures = [pool.submit(soak.worker, i) for i in range(workers)]
        if kill_every_s > 0:
            futures.append(pool.submit(kill_replicas, kill_every_s, soak.deadline, seed, kills))
        for future in futures:
            future.result()
    result.requests = sum(soak.statuses.values())
    result.served = sum(n for status, n in soak.statuses.items() if 200 <= status < 300)
    result.declared_503 = soak.declared_503
    result.unexpected_5xx = len(soak.unexpected)
    result.failed_explicitly = soak.failed_explicitly
    result.silent_truncations = len(soak.silent)
    result.replica_kills = len(kills)
    result.bad_input_mismatches = soak.mismatches
    result.disconnects = soak.disconnects
    result.statuses = {str(k): v for k, v in sorted(soak.statuses.items())}
    result.leaked_blocks = leaked_blocks(replicas)
    result.replica_rss_after = replica_memory()
    for line in soak.unexpected[:10] + soak.silent[:10]:
        print("unexpected:", line)
    return result


def report(result: SoakResult) -> None:
    mib = lambda d: ", ".join(f"{v / 2**20:.0f} MiB" for v in d.values()) or "?"  # noqa: E731
    print(f"{result.duration_s:.0f} s: {result.requests} requests, {result.served} served, "
          f"{result.declared_503} declared 503s, {result.disconnects} client disconnects, "
          f"{result.replica_kills} replicas killed; statuses {result.statuses}")
    print(f"streams ended by the declared error event and [DONE]: {result.failed_explicitly}")
    print(f"silent truncations (a stream or connection that stopped without an ending): "
          f"{result.silent_truncations} (must be 0)")
    print(f"5xx other than declared 503s: {result.unexpected_5xx} (must be 0)")
    print(f"bad inputs answered otherwise than declared: {len(result.bad_input_mismatches)} (must be 0) "
          f"{result.bad_input_mismatches[:3]}")
    print(f"KV blocks in use after the load: {result.leaked_blocks} (must be 0)")
    print(f"engine replica memory: before {mib(result.replica_rss_before)}, after {mib(result.replica_rss_after)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the running app (loopback only)")
    parser.add_argument("--start", action="store_true", help="start Ray and the app here instead (CPU)")
    parser.add_argument("--app-args", default="{}", help="JSON app args for --start, over the small CPU defaults")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-every-s", type=float, default=0.0,
                        help="kill -9 an engine replica this often during the load (default: 0, never)")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args(argv)
    if args.duration_s <= 0 or args.workers < 1:
        parser.error("--duration-s must be > 0 and --workers >= 1")
    if args.start:
        with started_app(args.app_args) as (url, key):
            result = run(url, args.api_key or key, args.duration_s, args.workers, args.seed, args.kill_every_s)
    else:
        _check_loopback(args.url)
        result = run(args.url, args.api_key, args.duration_s, args.workers, args.seed, args.kill_every_s)
    report(result)
    if args.json is not None:
        args.json.write_text(json.dumps({**asdict(result), "ok": result.ok}, indent=2))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
