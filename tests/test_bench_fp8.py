"""`ponytail bench --kv-cache-dtype fp8`: the engine runs twice on one workload (K/V in the model's
dtype, then in FP8) under the same budget, and both sides reach the tables, the CSV and the PNG."""

from __future__ import annotations

import csv
import json

import pytest
import torch

import ponytail
from ponytail.bench import command, run as bench_run
from ponytail.bench.memory import MemorySample, PoolSnapshot
from ponytail.bench.plot import plot_folder
from ponytail.bench.report import write_csv
from ponytail.bench.run import BenchConfig
from test_bench_command import SMALL, run


def parsed_config(monkeypatch, capsys, *argv) -> BenchConfig:
    """The BenchConfig the command builds from argv, without loading a model."""
    seen = []

    def fake_run_bench(config, progress):
        seen.append(config)
        raise KeyboardInterrupt  # the command's "stopped before any timing ran" exit: 130

    monkeypatch.setattr(command, "run_bench", fake_run_bench)
    code, out, err = run(capsys, "bench", *argv)
    assert code == 130 and seen, out + err
    return seen[0]


def test_kv_cache_dtype_flags_are_parsed_and_scales_default_on_with_fp8(monkeypatch, capsys):
    config = parsed_config(monkeypatch, capsys)
    assert (config.kv_cache_dtype, config.calculate_kv_scales) == ("auto", False)
    assert config.engine_sides() == [("ponytail", "auto")]
    config = parsed_config(monkeypatch, capsys, "--kv-cache-dtype", "fp8")
    assert (config.kv_cache_dtype, config.calculate_kv_scales) == ("fp8", True)
    assert config.engine_sides() == [("ponytail", "auto"), ("ponytail fp8", "fp8")]
    assert config.engine_kwargs("auto") == {}
    assert config.engine_kwargs("fp8") == {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}
    config = parsed_config(monkeypatch, capsys, "--kv-cache-dtype", "FP8_E4M3", "--no-calculate-kv-scales")
    assert (config.kv_cache_dtype, config.calculate_kv_scales) == ("fp8_e4m3", False)
    assert config.engine_sides()[1] == ("ponytail fp8_e4m3", "fp8_e4m3")


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-dtype", "fp16"], "--kv-cache-dtype='fp16' is not supported; allowed: auto, fp8, fp8_e4m3"),
    (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype='fp8_e5m2' is not supported; allowed: auto, fp8, fp8_e4m3"),
    (["--calculate-kv-scales"], "--calculate-kv-scales/--no-calculate-kv-scales applies to an FP8 KV cache; "
                                "allowed: with --kv-cache-dtype fp8 or fp8_e4m3"),
])
def test_bad_kv_cache_dtype_flags_fail_before_any_model_loads(capsys, monkeypatch, argv, message):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(bench_run, "load_model", no_load)
    code, _, err = run(capsys, "bench", *argv)
    assert code == 2
    assert message in err


def test_fp8_with_a_float32_model_on_cuda_is_refused_before_loading(monkeypatch):
    monkeypatch.setattr(bench_run, "resolve_device", lambda value, field: torch.device("cuda", 0))
    monkeypatch.setattr(bench_run, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    config = BenchConfig(kv_cache_dtype="fp8", dtype="float32", device="cuda")
    with pytest.raises(ponytail.ConfigError, match=r"--kv-cache-dtype fp8 with --dtype float32 on cuda:0"):
        bench_run.run_bench(config)


def test_bench_fp8_runs_both_dtypes_and_fp8_holds_more_under_the_same_budget(capsys, tmp_path, default_model):
    """A budget of two float32 blocks: the auto side runs at most two of the four requests at once,
    the FP8 side (one byte an element, a quarter of float32) all four."""
    out_dir = tmp_path / "bench"
    code, out, err = run(capsys, "bench", "--kv-cache-dtype", "fp8", "--requests", "4", *SMALL,
                         "--kv-cache-memory", "1536KiB", "--baseline", "none", "--out", str(out_dir))
    assert code == 0, out + err

    summary = json.loads((out_dir / "summary.json").read_text())
    assert set(summary["speed"]) == {"ponytail", "ponytail fp8"}
    assert all(s["requests_done"] == 4 for s in summary["speed"].values())
    auto, fp8 = summary["engines"]["ponytail"], summary["engines"]["ponytail fp8"]
    assert (auto["kv_cache_dtype"], auto["kv_dtype"], auto["scales"]) == ("auto", "float32", None)
    assert (fp8["kv_cache_dtype"], fp8["kv_dtype"], fp8["scales"]) == ("fp8", "float8_e4m3fn", "calculated")
    assert auto["budget_bytes"] == fp8["budget_bytes"] == 1536 * 1024
    assert fp8["bytes_per_token"] * 4 == auto["bytes_per_token"]
    assert fp8["capacity_tokens"] >= 4 * auto["capacity_tokens"] > 0
    assert auto["peak_running"] <= 2 < fp8["peak_running"] == 4
    assert 0 < fp8["pool_peak_bytes"] <= fp8["budget_bytes"]
    assert fp8["estimate"]["kv_cache_dtype"] == "fp8" and auto["estimate"]["kv_cache_dtype"] == "auto"
    assert summary["kv_pool_peak_bytes"] == auto["pool_peak_bytes"]  # the top level: the auto side, as before

    assert summary["output_check"]["passed"]  # judged on the auto side only
    agreement = summary["kv_agreement"]
    assert agreement["side"] == "ponytail fp8" and agreement["judged"] is False
    assert agreement["of"] == 2 * 3 and 0 <= agreement["same_tokens"] <= 6
    assert "greedy tokens" in out and "the same as the auto side's" in out and "reported, not failed" in out

    with (out_dir / "memory.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [s for s in dict.fromkeys(r["side"] for r in rows)] == ["ponytail", "ponytail fp8"]
    fp8_rows = [r for r in rows if r["side"] == "ponytail fp8"]
    assert float(fp8_rows[0]["t_s"]) < 0.5  # its own clock: seconds since the side started
    assert max(int(r["running"]) for r in fp8_rows) == 4 and int(fp8_rows[-1]["kv_used_bytes"]) == 0
    assert (out_dir / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    for text in ("ponytail fp8", "fp8 / auto", "KV stored as", "float8_e4m3fn",
                 "KV pool holds", "KV pool peak", "most running at once", "--kv-cache-dtype fp8 --max-batch-size 4"):
        assert text in out, text


def test_plot_draws_the_ponytail_sides_on_shared_axes_from_the_csv(tmp_path):
    def pool(nbytes, running):
        return PoolSnapshot(pool_bytes=nbytes, used_bytes=nbytes // 2, live_token_bytes=nbytes // 3,
                            running=running, waiting=0)

    samples = [MemorySample("generate", t / 10, None, None, None, 10**9 + t, None) for t in range(5)]
    samples += [MemorySample("ponytail", t / 10, None, None, None, 10**9, pool(4_000_000, 2)) for t in range(5)]
    samples += [MemorySample("ponytail fp8", t / 10, None, None, None, 10**9, pool(1_000_000, 4)) for t in range(5)]
    write_csv(samples, tmp_path / "memory.csv")
    estimate = {"total_bytes_blocks": 10**6, "gpu_memory": 2**22}
    (tmp_path / "summary.json").write_text(json.dumps({
        "device": "cpu", "dtype": "float32", "estimate": estimate,
        "engines": {"ponytail": {"kv_dtype": "float32", "scales": None, "estimate": estimate},
                    "ponytail fp8": {"kv_dtype": "float8_e4m3fn", "scales": "calculated", "estimate": estimate}},
        "config": {"requests": 2, "workload": "uniform", "prompt_len": 4, "output_len": 2}}))
    assert plot_folder(tmp_path).read_bytes()[:4] == b"\x89PNG"
