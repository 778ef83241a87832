"""benchmarks/bench_serve.py against Ponytail's API served in this process on the CPU (deployments.app.local_server):
a handful of streaming chat requests at two concurrencies, --compare on the same server twice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[1]


def bench_serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_bench_serve_compares_two_servers_on_the_same_requests(tmp_path):
    from deployments.app.local_server import local_server

    out = tmp_path / "serve.json"
    with local_server(engine={"max_num_seqs": 4}) as (_, url):
        result = bench_serve("--compare", f"{url}/v1,{url}/v1", "--small", "--requests", "4", "--concurrency", "2,4",
                             "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(r["server"], r["concurrency"]) for r in runs] == [("A", 2), ("B", 2), ("A", 4), ("B", 4)]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_serve import requests_for
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    expected = sum(n for _, n in requests_for(4, 0, 7680, 32))
    for r in runs:  # ignore_eos and min_tokens accepted: every stream has exactly max_tokens tokens
        assert r["errors"] == 0 and r["short_outputs"] == 0 and r["output_tokens"] == expected
        # the first id /v1/models lists: where the tokenizer loads from (the short name is its alias)
        assert r["model"].lower().endswith("smollm2-135m-instruct") and r["output_tokens_per_s"] > 0
        assert 0 < r["ttft_p50"] <= r["ttft_p90"] <= r["ttft_p99"] and 0 <= r["itl_p50"] <= r["itl_p99"]
    assert "concurrency 2: A/B output tokens/s" in result.stdout and "concurrency 4: A/B" in result.stdout


def test_bench_serve_counts_errors_instead_of_stopping(tmp_path):
    from deployments.app.local_server import local_server

    out = tmp_path / "serve.json"
    with local_server(engine={"max_num_seqs": 2}) as (_, url):
        result = bench_serve("--url", f"{url}/v1", "--model", "no-such-model", "--small", "--requests", "2",
                             "--concurrency", "2", "--json", str(out))
    assert result.returncode == 1
    run = json.loads(out.read_text())["runs"][0]
    assert run["errors"] == 2 and run["output_tokens"] == 0 and "NotFoundError" in run["error_examples"][0]


@pytest.mark.parametrize("args, message", [
    (["--url", "http://x/v1", "--concurrency", "0,4"], "--concurrency '0,4': expected integers >= 1, comma-separated"),
    (["--compare", "http://a/v1"], "--compare 'http://a/v1': expected two http(s) URLs, comma-separated"),
])
def test_bench_serve_refuses_bad_arguments(args, message):
    result = bench_serve(*args)
    assert result.returncode == 2 and message in result.stderr


def test_the_cpu_chat_wave_is_seeded_short_with_a_long_tail():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_serve import CPU_CHAT_LONG, cpu_chat_lengths, requests_for
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    pairs = cpu_chat_lengths(300, 0, 4096)
    assert pairs == cpu_chat_lengths(300, 0, 4096) and pairs != cpu_chat_lengths(300, 1, 4096)
    long = [p for p, _ in pairs if p >= CPU_CHAT_LONG[0]]
    assert 5 <= len(long) <= 30 and all(p <= CPU_CHAT_LONG[1] for p in long)  # ~5% of 300
    assert sorted(p for p, _ in pairs)[150] < 200 and all(8 <= n <= 256 for _, n in pairs)
    assert all(p + n <= 1200 for p, n in cpu_chat_lengths(50, 0, 1200))
    texts = requests_for(20, 0, 4096, 1, "cpu-chat")
    assert [len(t.split()) for t, _ in texts] == [p for p, _ in cpu_chat_lengths(20, 0, 4096)]


def test_side_by_side_builds_each_servers_app_yaml_and_refuses_unknown_args(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import argparse

    import serve_side_by_side as side

    assert side.parse_server("vllm") == ("vllm", {})
    assert side.parse_server("ponytail:engine_process=false;max_num_seqs=128") == (
        "ponytail", {"engine_process": "false", "max_num_seqs": "128"})
    config = side.ponytail_config("/models/x", {"engine_process": "false", "max_num_seqs": "128"})
    args = config["applications"][0]["args"]
    assert args["model"] == "/models/x" and args["engine_process"] is False and args["engine"]["max_num_seqs"] == 128
    assert args["engine"]["kv_cache_memory"] is None  # the rest stays as shipped
    with pytest.raises(SystemExit, match=r"unknown app args \['max_num_sequences'\]"):
        side.ponytail_config("/models/x", {"max_num_sequences": "8"})
    with pytest.raises(argparse.ArgumentTypeError, match="vllm runs with its defaults"):
        side.parse_server("vllm:gpu_memory_utilization=0.5")
    with pytest.raises(argparse.ArgumentTypeError, match="expected ponytail"):
        side.parse_server("sglang")
