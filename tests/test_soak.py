"""benchmarks/soak.py in its CPU-CI size: mixed load, disconnects, bad inputs, overload bursts and a
replica killed mid-load against the app it starts; no 5xx but declared 503s, every bad input its
declared status, every stream ended by its last chunk or the declared error, no leak."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.network  # the default model


@pytest.mark.chaos
def test_a_short_soak_serves_refuses_and_leaks_nothing(tmp_path, default_model):
    out = tmp_path / "soak.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--start", "--duration-s", "20",
                             "--workers", "3", "--seed", "1", "--app-args", '{"api_key": "sk-soak"}',
                             "--kill-every-s", "10",
                             "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    report = json.loads(out.read_text())
    assert report["ok"] and report["served"] > 0 and report["requests"] >= report["served"]
    assert report["unexpected_5xx"] == 0 and report["bad_input_mismatches"] == []
    assert report["replica_kills"] == 1 and report["silent_truncations"] == 0  # kill -9 at 10 s, Serve replaces it
    assert report["leaked_blocks"] == 0
    assert set(report["statuses"]) <= {"200", "400", "404", "413", "415", "503"}
    assert len(report["replica_rss_after"]) == 1
    assert "5xx other than declared 503s: 0 (must be 0)" in result.stdout
    assert "silent truncations (a stream or connection that stopped without an ending): 0 (must be 0)" in result.stdout


def test_soak_only_targets_loopback():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--url", "http://10.1.2.3:8000",
                             "--duration-s", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "--url 'http://10.1.2.3:8000': soak only targets loopback" in result.stderr
