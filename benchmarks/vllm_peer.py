"""vLLM's offline engine on bench_engine.py's requests, in a process of its own.

vLLM needs the image's transformers while Ponytail runs on its own pin, so the two never share a
process: `run_vllm` starts this file as a script under `--vllm-python` with `--vllm-pythonpath`,
hands it the requests as a JSON file and reads the results back from another. The worker builds
one `vllm.LLM(model=dir, dtype=..., seed=0)` with vLLM's defaults (torch.compile, CUDA graphs,
gpu_memory_utilization 0.9, prefix caching), so start-up is paid once for every workload; it runs
greedy, EOS ignored, the same prompt token ids and max_tokens as Ponytail.

Only the standard library is imported at the top: the parent (Ponytail's interpreter) imports this
module for `run_vllm`, the worker (vLLM's interpreter) runs it as a script.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

LOGPROBS = 20  # top logprobs per check step: Ponytail's MAX_LOGPROBS, within vLLM's default max_logprobs
# Set unless the caller's environment says otherwise: the offline bundle's README runs vLLM with these.
DEFAULT_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
KV_LOG = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
KV_TOKENS_LOG = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
# vLLM's own account of its memory (weights loaded, profiled activations, CUDA graphs, KV): what its
# budget subtracted, to set beside Ponytail's (bench_engine prints both)
MEMORY_LOG = re.compile(r"\bGiB\b.*\b(memory|graph|KV|took)\b|\b(memory|graph|KV|took)\b.*\bGiB\b", re.IGNORECASE)


def run_vllm(python: str, pythonpath: str | None, request: dict, workdir: Path, timeout: float) -> dict:
    """Run the worker on `request` (see `worker`); its results, or {"ok": False, "error": why}.
    Never raises for vLLM's own failures: the caller prints why and skips the peer."""
    workdir.mkdir(parents=True, exist_ok=True)
    inp, out, log = workdir / "vllm_in.json", workdir / "vllm_out.json", workdir / "vllm.log"
    out.unlink(missing_ok=True)
    env = {**DEFAULT_ENV, **os.environ}
    env.pop("PYTHONPATH", None)  # ours would put Ponytail's transformers in front of the image's
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    inp.write_text(json.dumps({**request, "spawned_at": time.time()}))
    try:
        with open(log, "w") as log_file:
            proc = subprocess.run([python, str(Path(__file__).resolve()), str(inp), str(out)], env=env,
                                  stdout=log_file, stderr=subprocess.STDOUT, timeout=timeout)
    except FileNotFoundError:
        return {"ok": False, "error": f"--vllm-python {python!r}: no such interpreter"}
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"the vLLM worker ran past {timeout:.0f} s; its log: {log}"}
    return read_results(workdir, f"the vLLM worker exited {proc.returncode} without results")


def read_results(workdir: Path, missing: str = "no results") -> dict:
    """The worker's results in `workdir` with what its log says of KV memory (also for --vllm-reuse)."""
    out, log = workdir / "vllm_out.json", workdir / "vllm.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    if not out.is_file():
        return {"ok": False, "error": f"{missing} in {workdir}; last lines of its log:\n"
                                      + "\n".join(text.splitlines()[-15:])}
    result = json.loads(out.read_text())
    if result.get("ok"):
        kv = KV_LOG.findall(text)
        tokens = KV_TOKENS_LOG.findall(text)
        result["kv"]["reserved_gib_logged"] = float(kv[-1]) if kv else None
        result["kv"]["tokens_logged"] = int(tokens[-1].replace(",", "")) if tokens else None
        memory = [line.strip()[-200:] for line in text.splitlines() if MEMORY_LOG.search(line)]
        result["kv"]["memory_lines"] = memory[:12]
    result["log"] = str(log)
    return result


def _sampling(SamplingParams, max_tokens: int, logprobs: int | None = None):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def _kv_config(llm) -> dict:
    """Blocks vLLM reserved, where this version says so (attribute paths move between releases)."""
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        return {"num_gpu_blocks": cache.num_gpu_blocks, "block_size": cache.block_size}
    except AttributeError:
        return {}


def _ttft(output) -> float | None:
    metrics = getattr(output, "metrics", None)
    for name in ("first_token_latency",):
        value = getattr(metrics, name, None)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    return None


def _on_cuda() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _prepare(llm, warmup: list[int], SamplingParams, TokensPrompt) -> None:
    """An empty prefix cache after a short unrelated request: no workload finds an earlier one's blocks."""
    if hasattr(llm, "reset_prefix_cache"):
        llm.reset_prefix_cache()
    llm.generate([TokensPrompt(prompt_token_ids=warmup)], _sampling(SamplingParams, 2), use_tqdm=False)
    if hasattr(llm, "reset_prefix_cache"):
        llm.reset_prefix_cache()


def _generate(llm, work: dict, SamplingParams, TokensPrompt):
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]
    return llm.generate(prompts, [_sampling(SamplingParams, n) for n in work["output_lens"]], use_tqdm=False)


def worker(request: dict) -> dict:
    """request: model, dtype, seed, check {prompts, steps}, warmup (a prompt),
    workloads [{name, prompts, output_lens}], spawned_at (the parent's time.time() at spawn), and
    optionally rounds (timed runs of each workload, default 1) and profile (workload names run once
    more under kernel_time.recorded, after the timing)."""
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except Exception as exc:  # not importable here: the caller says so and skips vLLM
        return {"ok": False, "error": f"vllm is not importable by {sys.executable} with "
                                      f"PYTHONPATH={os.environ.get('PYTHONPATH')!r}: {type(exc).__name__}: {exc}"}
    imported_at = time.time()
    # Its defaults, but for the arguments the peer names ("vllm:kv_cache_dtype=fp8").
    llm = LLM(model=request["model"], dtype=request["dtype"], seed=request["seed"], **request.get("engine_args", {}))
    ready_at = time.time()
    first = request["workloads"][0]["prompts"][0]
    llm.generate([TokensPrompt(prompt_token_ids=first)], _sampling(SamplingParams, 1), use_tqdm=False)
    first_token_at = time.time()
    spawned = request["spawned_at"]
    start = {"process_to_ready_s": ready_at - spawned, "process_to_first_token_s": first_token_at - spawned,
             "llm_to_ready_s": ready_at - imported_at, "llm_to_first_token_s": first_token_at - imported_at,
             "interpreter_and_import_s": imported_at - spawned}
    check = request["check"]
    checked = []
    if check["steps"] > 0:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in check["prompts"]],
                            _sampling(SamplingParams, check["steps"], LOGPROBS), use_tqdm=False)
        for o in outs:
            c = o.outputs[0]
            checked.append({"token_ids": list(c.token_ids),
                            "logprobs": [{str(t): float(lp.logprob) for t, lp in step.items()} for step in c.logprobs]})
    results = []  # one entry per workload and round, rounds of a workload back to back
    for work in request["workloads"]:
        for _ in range(request.get("rounds", 1)):
            _prepare(llm, request["warmup"], SamplingParams, TokensPrompt)
            t0 = time.perf_counter()
            outs = _generate(llm, work, SamplingParams, TokensPrompt)
            seconds = time.perf_counter() - t0
            produced = sum(len(o.outputs[0].token_ids) for o in outs)
            ttfts = sorted(t for t in map(_ttft, outs) if t is not None)
            results.append({"name": work["name"], "seconds": seconds, "output_tokens": produced,
                            "expected_output_tokens": sum(work["output_lens"]),
                            "prompt_tokens": sum(len(p) for p in work["prompts"]),
                            "ttfts": ttfts})
    profiles = {}
    for work in (w for w in request["workloads"] if w["name"] in request.get("profile", ())):
        import kernel_time  # beside this file: on sys.path when it runs as a script

        _prepare(llm, request["warmup"], SamplingParams, TokensPrompt)
        with kernel_time.recorded("cuda" if _on_cuda() else "cpu") as profiles[work["name"]]:
            _generate(llm, work, SamplingParams, TokensPrompt)
    return {"ok": True, "version": vllm.__version__, "start": start, "kv": _kv_config(llm),
            "check": checked, "results": results, "profiles": profiles}


if __name__ == "__main__":
    request_path, result_path = sys.argv[1], sys.argv[2]
    result = worker(json.loads(Path(request_path).read_text()))
    Path(result_path).write_text(json.dumps(result))
    sys.exit(0 if result["ok"] else 3)
