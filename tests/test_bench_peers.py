"""bench_engine's side-by-side mode (peer_bench, vllm_peer, peer_workloads) and bench_serve, on the CPU.

There is no vLLM here: its process is exercised with a stand-in `vllm` package (written below into
a temporary PYTHONPATH) that runs transformers' greedy generate on the same checkpoint and answers
in vLLM's offline API shapes. What is tested is the plumbing around vLLM (its own interpreter and
PYTHONPATH, JSON in and out, the fp32 check of its tokens, the table), not vLLM's speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import peer_workloads  # noqa: E402
from peer_workloads import build, mixed_lengths  # noqa: E402

sys.path.remove(str(ROOT / "benchmarks"))

STAND_IN = '''
"""A stand-in for vLLM's offline API (tests only): transformers' greedy generate in float32."""
import os
from dataclasses import dataclass
import torch
from transformers import AutoModelForCausalLM

__version__ = "stand-in"
SHIFT = int(os.environ.get("STAND_IN_SHIFT", "0"))  # > 0: every token off by this much (a broken engine)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    logprobs: int | None = None


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list
    logprobs: list | None


@dataclass
class RequestOutput:
    outputs: list


class LLM:
    def __init__(self, model, dtype="auto", seed=0):
        print("INFO Model loading took 0.5 GiB memory and 1.0 seconds")  # its memory account, kept
        print("INFO Available KV cache memory: 1.25 GiB")  # the line vLLM logs, parsed by the parent
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def reset_prefix_cache(self):
        return True

    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        return [self._one(p["prompt_token_ids"], sp) for p, sp in zip(prompts, params)]

    def _one(self, ids, sp):
        ids = torch.tensor([ids])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=sp.max_tokens,
                                  min_new_tokens=sp.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                                  output_logits=True, return_dict_in_generate=True)
        tokens = [(t + SHIFT) % self.model.config.vocab_size for t in out.sequences[0, ids.shape[1]:].tolist()]
        logprobs = None
        if sp.logprobs:
            logprobs = []
            for step, chosen in zip(out.logits, tokens):
                lp = torch.log_softmax(step[0].float(), -1)
                top = {int(i): Logprob(float(lp[i])) for i in torch.topk(lp, sp.logprobs).indices}
                logprobs.append({**top, chosen: Logprob(float(lp[chosen]))})
        return RequestOutput([CompletionOutput(tokens, logprobs)])
'''


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stand_in_vllm")
    (path / "vllm").mkdir()
    (path / "vllm" / "__init__.py").write_text(STAND_IN)
    (path / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                             "    return {'prompt_token_ids': prompt_token_ids}\n")
    return path


def bench_engine(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--small", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def test_mixed_lengths_are_seeded_chat_like_and_fit_the_model():
    pairs = mixed_lengths(2000, seed=0)
    assert pairs == mixed_lengths(2000, seed=0) and pairs != mixed_lengths(2000, seed=1)
    prompts = sorted(p for p, _ in pairs)
    outputs = sorted(o for _, o in pairs)
    assert prompts[len(prompts) // 2] < 400  # most prompts are short
    assert 0.05 < sum(p >= 1500 for p in prompts) / len(prompts) < 0.15  # a long tail...
    assert 5000 < prompts[-1] <= 6000  # ...up to ~6k
    assert outputs[0] == 16 and outputs[-1] == 1536 and 100 < outputs[len(outputs) // 2] < 200
    assert all(p + o <= 4096 for p, o in mixed_lengths(500, seed=0, max_len=4096))


def test_workloads_have_their_shapes_and_share_no_prompts():
    kinds = {name: build(name, vocab_size=32000, max_len=8192) for name in peer_workloads.WORKLOADS}
    assert [len(p) for p in kinds["fixed"].prompts] == [512] * 64 and kinds["fixed"].output_lens == [1024] * 64
    assert [len(p) for p in kinds["long"].prompts] == [4096] * 16 and kinds["long"].output_lens == [512] * 16
    prefix = kinds["prefix"].prompts
    assert len(prefix) == 256 and all(p[:2048] == prefix[0][:2048] for p in prefix)
    assert len({tuple(p[2048:]) for p in prefix}) == 256
    mixed, prefill, decode = kinds["mixed"], kinds["prefill"], kinds["decode"]
    assert [len(p) for p in prefill.prompts] == [len(p) for p in mixed.prompts] and set(prefill.output_lens) == {1}
    assert decode.output_lens == mixed.output_lens and all(16 <= len(p) <= 64 for p in decode.prompts)
    assert prefill.metric == "prompt" and mixed.metric == "output"
    firsts = [tuple(w.prompts[0][:8]) for w in kinds.values()]
    assert len(set(firsts)) == len(firsts)  # own token ids: no workload hits another's prefix cache
    with pytest.raises(ValueError, match="--workload long: 4096 \\+ 512 tokens per request do not fit the model's "
                                         "4096 positions"):
        build("long", vocab_size=32000, max_len=4096)


@pytest.mark.slow
def test_bench_engine_runs_vllm_in_its_own_process_and_checks_its_tokens(stand_in, tmp_path):
    out = tmp_path / "peers.json"
    result = bench_engine("--workload", "prefill", "--peers", "ponytail,vllm", "--check-tokens", "4",
                          "--vllm-pythonpath", str(stand_in), "--vllm-workdir", str(tmp_path / "vllm"),
                          "--profile", "prefill", "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    for peer in ("ponytail", "vllm"):  # fp32 on the CPU: both give the reference's own tokens
        check = report["check"][peer]
        assert check["passed"] and check["ponytail"]["exact_steps"] == check["of"] == 2 * 4
    vllm, ours = report["results"]["vllm"]["prefill"], report["results"]["ponytail"]["prefill"]
    assert vllm["output_tokens"] == ours["output_tokens"] == 6 and vllm["prompt_tokens"] == ours["prompt_tokens"]
    assert report["vllm"]["kv"]["reserved_gib_logged"] == 1.25
    assert report["vllm"]["kv"]["memory_lines"] == [
        "INFO Model loading took 0.5 GiB memory and 1.0 seconds", "INFO Available KV cache memory: 1.25 GiB"]
    assert "vllm log: INFO Model loading took 0.5 GiB" in result.stdout
    lines = result.stdout.splitlines()  # vLLM's round printed once its process returned, before ours ran
    first = {peer: next(i for i, line in enumerate(lines) if line.startswith(f"{peer} prefill: ")) for peer in
             ("vllm", "ponytail")}
    assert first["vllm"] < first["ponytail"]
    assert any(line.startswith("ponytail: LLM(dir) to first token ") and " GB" in line for line in lines)
    start = report["start"]["vllm"]
    assert 0 < start["llm_to_ready_s"] <= start["llm_to_first_token_s"] <= start["process_to_first_token_s"]
    assert 0 < report["start"]["ponytail"]["llm_to_ready_s"] <= report["start"]["ponytail"]["llm_to_first_token_s"]
    assert "ponytail / vllm" in result.stdout and "LLM() to first token" in result.stdout
    for peer in ("ponytail", "vllm"):  # --profile: each engine's run once more under torch.profiler
        profile = report["profiles"][peer]["prefill"]
        assert 0 < profile["kernel_s"] and profile["kernels"] > 0 and 0 < profile["wall_s"]
        assert sum(profile["by_kind_s"].values()) == pytest.approx(profile["kernel_s"])
        assert profile["top"][0]["name"].startswith("aten::")  # on the CPU, top-level aten ops stand in
    assert "prefill: device time by kind of kernel" in result.stdout
    again = bench_engine("--workload", "decode", "--peers", "vllm", "--vllm-reuse", "--vllm-workdir",
                         str(tmp_path / "vllm"))  # results of other requests are not taken
    assert again.returncode == 1
    assert f"vllm: skipped: --vllm-reuse: {tmp_path / 'vllm'} holds other workloads or check requests" in again.stdout


def test_bench_engine_rounds_time_each_engine_again_and_report_the_median_and_spread(stand_in, tmp_path):
    out = tmp_path / "rounds.json"
    result = bench_engine("--workload", "decode", "--peers", "ponytail,vllm", "--check-tokens", "0", "--rounds", "3",
                          "--vllm-pythonpath", str(stand_in), "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    for peer in ("ponytail", "vllm"):
        decode = report["results"][peer]["decode"]
        assert len(decode["rounds"]) == 3 and decode["output_tokens_per_s"] == sorted(decode["rounds"])[1]
    assert "decode rounds: vllm " in result.stdout and "over every pairing" in result.stdout


@pytest.mark.slow
def test_bench_engine_stops_before_timing_when_vllm_tokens_are_wrong(stand_in, tmp_path):
    result = bench_engine("--workload", "prefill", "--peers", "vllm", "--check-tokens", "4",
                          "--vllm-pythonpath", str(stand_in), env={"STAND_IN_SHIFT": "1"})
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "vllm: output check FAIL" in result.stdout and "WRONG: request 0 step 0" in result.stdout
    assert "vllm produces wrong tokens: not timed" in result.stderr


def test_bench_engine_skips_vllm_where_it_is_not_importable_and_check_tokens_0_skips_the_check(tmp_path):
    result = bench_engine("--workload", "decode", "--peers", "ponytail,vllm", "--check-tokens", "0",
                          "--vllm-pythonpath", str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"vllm: skipped: vllm is not importable by {sys.executable} with PYTHONPATH='{tmp_path}'" in result.stdout
    assert "ponytail: output check skipped (--check-tokens 0)" in result.stdout
    assert "decode (6 req" in result.stdout


def test_bench_engine_refuses_in_process_peers_in_the_side_by_side_mode():
    result = bench_engine("--workload", "mixed", "--peers", "plain,ponytail")
    assert result.returncode == 2
    assert "--peers plain / --capacity: only with --workload fixed" in result.stderr


def test_bench_engine_refuses_to_profile_a_workload_it_does_not_run():
    result = bench_engine("--workload", "mixed", "--peers", "ponytail", "--profile", "prefill")
    assert result.returncode == 2
    assert "--profile prefill: expected workloads of --workload (mixed)" in result.stderr
