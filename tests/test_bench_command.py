"""`ponytail bench`: the whole command on the default model (CPU), its output check failing on an
injected wrong token, and the pieces (verdict, weights round trip, workloads, config, CSV)."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ponytail
from ponytail.bench.memory import MemorySample, PoolSnapshot
from ponytail.bench.output_check import check_outputs, float32_weights, judge, logit_error
from ponytail.bench.plot import plot_folder, read_csv
from ponytail.bench.report import CSV_COLUMNS, write_csv
from ponytail.bench.run import BenchConfig
from ponytail.bench.speed import percentile
from ponytail.bench.workload import make_workload
from ponytail.cli import main
from ponytail.engine import llm_engine

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--prompt-len", "8", "--output-len", "4", "--check-requests", "2", "--check-tokens", "3",
         "--sample-interval", "0.02"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_on_the_default_model_writes_the_png_csv_and_both_sides(capsys, tmp_path, default_model):
    out_dir = tmp_path / "bench"
    code, out, err = run(capsys, "bench", "--requests", "3", "--workload", "mixed", *SMALL, "--idle", "0.3",
                         "--kv-release-after", "0", "--out", str(out_dir))
    assert code == 0, out + err
    assert (out_dir / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with (out_dir / "memory.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert {r["side"] for r in rows} == {"generate", "ponytail"}
    assert all(int(r["rss_bytes"]) > 0 and r["device_used_bytes"] == "" for r in rows)  # CPU: process RSS
    ours = [r for r in rows if r["side"] == "ponytail"]
    assert all(int(r["kv_pool_bytes"]) > 0 for r in ours)  # the pool on the same time axis, from the start
    assert max(int(r["kv_used_bytes"]) for r in ours) > 0 and max(int(r["running"]) for r in ours) > 0
    assert int(ours[-1]["kv_used_bytes"]) == 0  # all finished: every block back
    assert all(r["kv_pool_bytes"] == "" for r in rows if r["side"] == "generate")
    times = [float(r["t_s"]) for r in ours]
    assert times == sorted(times)

    summary = json.loads((out_dir / "summary.json").read_text())
    check = summary["output_check"]
    assert check["passed"] and check["ponytail"]["wrong"] == [] and check["ponytail"]["near_ties"] == []
    assert check["ponytail"]["exact_steps"] == check["of"] == 2 * 3  # fp32: the reference's tokens exactly
    workload = make_workload("mixed", 3, 8, 4, default_model[0].config.vocab_size)
    for side in ("generate", "ponytail"):
        speed = summary["speed"][side]
        assert speed["requests_done"] == 3 and speed["output_tokens"] == workload.output_tokens
        assert speed["tokens_per_s"] > 0 and speed["ttft"]["50"] > 0 and not speed["interrupted"]
    assert summary["estimate"]["max_batch_size"] == 3 and summary["estimate"]["max_seq_len"] == workload.max_seq_len
    assert summary["kv_pool_peak_bytes"] >= summary["estimate"]["total_bytes_blocks"] > 0
    assert "ponytail / generate" in out and "output tokens/s" in out and "TPOT p99" in out
    assert "estimate (ponytail estimate --num-layers 30 --num-kv-heads 3 --head-dim 64" in out
    assert "output check: PASS" in out


def test_bench_output_check_fails_when_the_engine_produces_a_wrong_token(capsys, tmp_path, monkeypatch,
                                                                          default_model):
    real_sample, calls = llm_engine.sample, []

    def faulty_sample(logits, batch):
        result = real_sample(logits, batch)
        calls.append(1)
        if len(calls) == 2:  # the second step: the first request's least likely token instead
            tokens = result.token_ids.clone()
            tokens[0] = logits[0].argmin()
            result = dataclasses.replace(result, token_ids=tokens)
        return result

    monkeypatch.setattr(llm_engine, "sample", faulty_sample)
    out_dir = tmp_path / "bench"
    code, out, _ = run(capsys, "bench", "--requests", "2", *SMALL, "--out", str(out_dir))
    assert code == 1
    assert "output check: FAIL" in out and "WRONG: request 0 step 1" in out and "not timed" in out
    check = json.loads((out_dir / "summary.json").read_text())["output_check"]
    assert not check["passed"]
    [wrong] = check["ponytail"]["wrong"]
    assert (wrong["row"], wrong["step"]) == (0, 1) and wrong["gap"] > 1.0
    assert check["plain"]["wrong"] == []
    assert not (out_dir / "memory.csv").exists()  # no speed or memory quoted for wrong outputs


def test_bench_check_tokens_0_skips_the_check_and_still_measures(capsys, tmp_path, default_model):
    code, out, _ = run(capsys, "bench", "--requests", "1", "--prompt-len", "4", "--output-len", "2",
                       "--check-tokens", "0", "--baseline", "none", "--out", str(tmp_path))
    assert code == 0
    assert "output check: skipped (--check-tokens 0)" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["output_check"]["checked"] is False and set(summary["speed"]) == {"ponytail"}
    assert (tmp_path / "memory.png").exists()


def test_bench_ctrl_c_stops_cleanly_and_writes_what_ran(capsys, tmp_path, monkeypatch, default_model):
    real_step, calls = llm_engine.LLMEngine.step, []

    def step(self):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(llm_engine.LLMEngine, "step", step)
    code, out, _ = run(capsys, "bench", "--requests", "2", "--prompt-len", "4", "--output-len", "8",
                       "--check-tokens", "0", "--baseline", "none", "--out", str(tmp_path))
    assert code == 130 and "stopped by Ctrl-C" in out
    speed = json.loads((tmp_path / "summary.json").read_text())["speed"]["ponytail"]
    assert speed["interrupted"] and speed["requests_done"] == 0 and 0 < speed["output_tokens"] < 16
    with (tmp_path / "memory.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert rows and int(rows[-1]["kv_used_bytes"]) == 0  # aborted requests gave their blocks back


@pytest.mark.parametrize("argv, message", [
    (["--workload", "burst"], "--workload 'burst' is not supported; allowed: uniform, mixed, prefix"),
    (["--baseline", "vllm"], "--baseline 'vllm' is not supported; allowed: generate, none"),
    (["--requests", "0"], "--requests 0 is invalid; allowed: an integer >= 1"),
    (["--check-tokens", "-1"], "--check-tokens -1 is invalid; allowed: an integer >= 0"),
    (["--idle", "-2"], "--idle -2.0 is invalid; allowed: seconds >= 0"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory='lots' is not a byte size"),
])
def test_bench_refuses_bad_flags_before_loading_a_model(capsys, argv, message):
    code, _, err = run(capsys, "bench", *argv)
    assert code == 2
    assert message in err


# ------------------------------------------------------------------ the verdict itself
def test_judge_accepts_a_near_tie_and_refuses_a_far_token():
    ref = torch.tensor([[5.0, 4.99, 0.0], [5.0, 4.99, 0.0], [5.0, 4.99, 0.0]])
    verdict = judge([[0, 1, 2]], [ref], tolerance=0.05, error=0.0)
    assert verdict.exact_steps == 1
    assert [(f.step, f.chosen, f.best) for f in verdict.near_ties] == [(1, 1, 0)]
    assert [(f.step, f.chosen, f.best, f.gap) for f in verdict.wrong] == [(2, 2, 0, 5.0)]


def test_logit_error_compares_differences_so_logprobs_and_logits_agree():
    ref = torch.tensor([[3.0, 1.0, 0.0]])
    shifted = {0: 3.0 - 10, 1: 1.0 - 10, 2: 0.5 - 10}  # logprobs: logits minus a constant, one 0.5 off
    assert logit_error([0], [shifted], ref) == pytest.approx(0.5)
    assert logit_error([0], ref + 7, ref) == 0.0


def test_float32_weights_round_trip_is_exact_and_keeps_each_dtype():
    model = tiny_llama(torch.bfloat16)
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.float()  # fp32 buffer in a bf16 model
    before = {n: t.clone() for n, t in model.state_dict().items()}
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    with float32_weights(model):
        assert all(p.dtype == torch.float32 for p in model.parameters())
    # Its own storage back, not a new cast: a cast back fragments the device's allocator (see the docstring).
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == storage
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == before[name].dtype and torch.equal(tensor, before[name]), name


def test_output_check_in_bf16_passes_with_near_ties_and_fails_on_a_wrong_token(monkeypatch):
    """A tiny random model in bf16 has near ties everywhere: Ponytail and plain generate part
    ways, and the check must still pass; one wrong token must still fail it."""
    model = tiny_llama(torch.bfloat16)
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(12)] for _ in range(4)]

    def generate(batch, params):
        return ponytail.LLM(model, kv_cache_memory="16MiB", max_model_len=64).generate(batch, params)

    verdict = check_outputs(model, prompts, 24, generate)
    assert verdict.passed, verdict.summary()
    assert verdict.plain.wrong == [] and verdict.tolerance > 0
    assert next(model.parameters()).dtype == torch.bfloat16

    real_sample = llm_engine.sample

    def faulty_sample(logits, batch):
        result = real_sample(logits, batch)
        tokens = result.token_ids.clone()
        tokens[-1] = logits[-1].argmin()
        return dataclasses.replace(result, token_ids=tokens)

    monkeypatch.setattr(llm_engine, "sample", faulty_sample)
    verdict = check_outputs(model, prompts, 4, generate)
    assert not verdict.passed and verdict.ponytail.wrong


def tiny_llama(dtype):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    return LlamaForCausalLM(config).to(dtype).eval()


# ------------------------------------------------------------------ workloads, config, files
def test_workloads_have_the_promised_shapes():
    uniform = make_workload("uniform", 5, 20, 7, 1000)
    assert [len(p) for p in uniform.prompts] == [20] * 5 and uniform.output_lens == [7] * 5
    mixed = make_workload("mixed", 50, 20, 8, 1000)
    assert all(5 <= len(p) <= 20 for p in mixed.prompts) and all(2 <= n <= 8 for n in mixed.output_lens)
    assert len({len(p) for p in mixed.prompts}) > 1 and mixed.max_seq_len <= 28
    prefix = make_workload("prefix", 4, 20, 3, 1000)
    assert len({tuple(p[:15]) for p in prefix.prompts}) == 1 and len({tuple(p) for p in prefix.prompts}) == 4
    assert all(10 <= t < 1000 for p in mixed.prompts for t in p)


def test_bench_config_names_the_flag():
    with pytest.raises(ponytail.ConfigError, match=r"--baseline-batch 0 is invalid; allowed: an integer >= 1"):
        BenchConfig(baseline_batch=0)
    with pytest.raises(ponytail.ConfigError, match=r"--sample-interval 0 is invalid; allowed: seconds > 0"):
        BenchConfig(sample_interval=0)


def test_percentile_interpolates_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([], 50) != percentile([], 50)  # nan


def test_csv_leaves_cells_empty_where_a_count_does_not_apply(tmp_path):
    pool = PoolSnapshot(pool_bytes=100, used_bytes=40, live_token_bytes=30, running=2, waiting=1)
    samples = [MemorySample("generate", 0.0, None, 10, 20, None, None),
               MemorySample("ponytail", 0.5, 999, 11, 21, None, pool)]
    with write_csv(samples, tmp_path / "m.csv").open() as f:
        rows = list(csv.reader(f))
    assert rows == [list(CSV_COLUMNS), ["generate", "0.0000", "", "10", "20", "", "", "", "", "", ""],
                    ["ponytail", "0.5000", "999", "11", "21", "", "100", "40", "30", "2", "1"]]


def test_plot_redraws_the_png_from_the_csv_it_reads_back(tmp_path):
    pool = PoolSnapshot(pool_bytes=2_000_000, used_bytes=500_000, live_token_bytes=400_000, running=1, waiting=0)
    samples = [MemorySample("generate", t / 10, None, None, None, 10**9 + t, None) for t in range(5)]
    samples += [MemorySample("ponytail", t / 10, None, None, None, 10**9, pool) for t in range(5)]
    write_csv(samples, tmp_path / "memory.csv")
    (tmp_path / "summary.json").write_text(json.dumps({
        "device": "cpu", "dtype": "float32", "estimate": {"total_bytes_blocks": 10**6, "gpu_memory": 2**31},
        "config": {"requests": 2, "workload": "uniform", "prompt_len": 4, "output_len": 2}}))
    assert read_csv(tmp_path / "memory.csv") == samples
    assert plot_folder(tmp_path).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.gpu
def test_bench_on_cuda_samples_device_memory_and_passes_the_check_in_bf16(capsys, tmp_path):
    """On the GPU machine: a SmolLM2-shaped random checkpoint (the GGUF cannot be carried there)."""
    pytest.importorskip("rich")
    files = ROOT / ".gpu" / "smollm2-files"
    if not (files / "config.json").is_file():
        pytest.skip("needs .gpu/smollm2-files: python benchmarks/random_checkpoint.py export .gpu/smollm2-files")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from random_checkpoint import build_checkpoint
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    checkpoint = build_checkpoint(files, tmp_path / "model")
    code, out, err = run(capsys, "bench", str(checkpoint), "--device", "cuda", "--requests", "8", "--prompt-len",
                         "64", "--output-len", "32", "--workload", "mixed", "--check-tokens", "16",
                         "--kv-cache-memory", "1GiB", "--kv-release-after", "0", "--idle", "1",
                         "--out", str(tmp_path / "bench"))
    assert code == 0, out + err
    summary = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert summary["dtype"] == "bfloat16" and summary["output_check"]["passed"]
    assert summary["memory_source"] in ("NVML + torch allocator", "torch allocator")
    with (tmp_path / "bench" / "memory.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert all(int(r["torch_allocated_bytes"]) > 0 and r["rss_bytes"] == "" for r in rows)
    assert summary["speed"]["ponytail"]["requests_done"] == summary["speed"]["generate"]["requests_done"] == 8
    if importlib.util.find_spec("matplotlib") is not None:  # without it: the CSV, and a hint to redraw
        assert (tmp_path / "bench" / "memory.png").exists()
