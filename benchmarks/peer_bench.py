"""bench_engine.py's side-by-side mode: Ponytail with its defaults against vLLM with its defaults,
over the workloads of peer_workloads.py, from one checkpoint directory.

Order: vLLM first, in its own process (vllm_peer.py), before this process touches the device,
since vLLM reserves 90% of the device memory at start; then Ponytail here. Each side's start is
timed: vLLM from process start (and from `LLM()`) to engine ready and to the first token of the
first request; Ponytail from `LLM(dir)` to the same. Then each side's greedy tokens on a short
sample are judged by ponytail.bench.output_check (the float32 judge of `ponytail bench`): a token
other than the fp32 reference's best passes only within the dtype's rounding bound. A side that
fails is not timed; `--check-tokens 0` skips the check and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
import yaml
from rich.console import Console
from rich.table import Table
from torch._subclasses.fake_tensor import FakeTensor

import ponytail
from ponytail import SamplingParams
from ponytail.attention import decode as decode_kernel
from ponytail.bench.output_check import check_outputs
from ponytail.config import TuningConfig, field_owners
from ponytail.runner.compile import can_compile, restore_decoder_layers
from ponytail.runner.fused_projections import can_fuse, unfuse_projections
from ponytail.runner.gemm_layout import row_major_weights

import kernel_time
import peer_workloads
from vllm_peer import read_results, run_vllm

# peer -> compile_model; None: what LLM(dir) chooses (see llm_args_for)
VARIANTS = {"ponytail": None, "ponytail_eager": False, "ponytail_compiled": True}
# LLM arguments every Ponytail peer gets from the benchmark (the variant's own compile_model included);
# kv_cache_memory is --kv-memory's unless the peer names its own.
_SET_HERE = {"model", "tokenizer", "compile_model", "dtype", "device"}
TUNING = {field.name for field in dataclasses.fields(TuningConfig)}  # named flat in a peer, passed as tuning
# A peer argument named decode.<key> overrides ponytail.attention.decode.LAUNCH[key] while that peer runs;
# one named inductor.<option> patches torch._inductor.config's option (e.g. triton.enable_pdl) likewise.
LAUNCH_PREFIX = "decode."
INDUCTOR_PREFIX = "inductor."


# vllm.LLM arguments a vllm peer may carry ("vllm:kv_cache_dtype=fp8"), to compare like with like.
VLLM_ARGS = ("kv_cache_dtype", "calculate_kv_scales", "gpu_memory_utilization", "max_num_seqs",
             "max_num_batched_tokens", "enable_prefix_caching", "block_size")


def split_vllm_peer(peers: list[str]) -> tuple[list[str], dict]:
    """peers with 'vllm:k=v;...' made 'vllm', and those vllm.LLM arguments (values as YAML scalars).
    Raises ValueError naming an argument outside VLLM_ARGS, or a second vllm peer (vLLM runs once)."""
    found = [p for p in peers if p.partition(":")[0] == "vllm"]
    if len(found) > 1:
        raise ValueError(f"--peers: one vllm peer at most (it runs in its own process once), got {found}")
    engine_args = {}
    for item in filter(None, (found[0].partition(":")[2] if found else "").split(";")):
        name, eq, value = (part.strip() for part in item.partition("="))
        if not eq or name not in VLLM_ARGS:
            raise ValueError(f"--peers {found[0]!r}: {item!r}: expected <argument>=<value> with an argument of "
                             f"{', '.join(VLLM_ARGS)}")
        engine_args[name] = yaml.safe_load(value)
    return ["vllm" if p in found else p for p in peers], engine_args


def parse_peer(peer: str) -> tuple[str, dict]:
    """'ponytail:max_num_batched_tokens=16384;decode.decode_warps=8' -> ('ponytail', {kwargs});
    values are YAML scalars; decode.<key> names a decode-kernel launch tunable (an int), inductor.<option>
    an option of torch._inductor.config (a value of its default's type), the rest LLM arguments. A plain
    name comes back with no kwargs. Raises ValueError, naming the argument, for a kwarg LLM does not
    take, one the benchmark sets itself, or an unknown launch key or inductor option."""
    base, sep, rest = peer.partition(":")
    if not sep:
        return peer, {}
    if base not in VARIANTS:
        raise ValueError(f"--peers {peer!r}: LLM arguments go after one of {', '.join(VARIANTS)}, not {base!r}")
    allowed = (set(field_owners()) | TUNING) - _SET_HERE
    kwargs = {}
    for item in filter(None, rest.split(";")):
        name, eq, value = (part.strip() for part in item.partition("="))
        if eq and name.startswith(LAUNCH_PREFIX):
            key, parsed = name[len(LAUNCH_PREFIX):], yaml.safe_load(value)
            if key not in decode_kernel.LAUNCH or type(parsed) is not int:
                raise ValueError(f"--peers {peer!r}: {name}={value!r}: expected decode.<key>=<int> with a key of "
                                 f"ponytail.attention.decode.LAUNCH ({', '.join(decode_kernel.LAUNCH)})")
            kwargs[name] = parsed
            continue
        if eq and name.startswith(INDUCTOR_PREFIX):
            kwargs[name] = inductor_option(peer, name, value)
            continue
        if not eq or name not in allowed:
            raise ValueError(f"--peers {peer!r}: expected name=value with a name LLM takes; got {item!r} "
                             f"(allowed: {', '.join(sorted(allowed))}, decode.<launch key> or inductor.<option>)")
        kwargs[name] = yaml.safe_load(value)
    tuning = {name: kwargs.pop(name) for name in list(kwargs) if name in TUNING}  # LLM takes them as tuning={...}
    return base, {**kwargs, "tuning": tuning} if tuning else kwargs


def inductor_option(peer: str, name: str, value: str):
    """inductor.<option>=<value>: the option must be torch._inductor.config's, the value of its type."""
    options = inductor_config.get_config_copy()
    option, parsed = name[len(INDUCTOR_PREFIX):], yaml.safe_load(value)
    if option not in options or type(parsed) is not type(options[option]):
        expected = "an option of torch._inductor.config" if option not in options else (
            f"a {type(options[option]).__name__}, as its default {options[option]!r}")
        raise ValueError(f"--peers {peer!r}: {name}={value!r}: expected inductor.<option>=<value> with {expected}")
    return parsed


@contextlib.contextmanager
def peer_launch(peer: str):
    """The peer's decode.<key> overrides in ponytail.attention.decode.LAUNCH and its inductor.<option>
    patches of torch._inductor.config while it runs (its engine plans, compiles and captures with them),
    the previous values after. With inductor options, dynamo's caches are reset on the way in and out,
    so that neither this peer nor the next reuses layers compiled under the other's options."""
    own = parse_peer(peer)[1]
    overrides = {k[len(LAUNCH_PREFIX):]: v for k, v in own.items() if k.startswith(LAUNCH_PREFIX)}
    inductor = {k[len(INDUCTOR_PREFIX):]: v for k, v in own.items() if k.startswith(INDUCTOR_PREFIX)}
    saved = dict(decode_kernel.LAUNCH)
    decode_kernel.LAUNCH.update(overrides)
    patch = contextlib.nullcontext()
    if inductor:
        torch._dynamo.reset()
        patch = inductor_config.patch(inductor)
    try:
        with patch:
            yield
    finally:
        decode_kernel.LAUNCH.clear()
        decode_kernel.LAUNCH.update(saved)
        if inductor:
            torch._dynamo.reset()


@dataclass(frozen=True, slots=True)
class _Completion:
    logprobs: list[dict[int, float]]  # per step, token id -> logprob, as Ponytail's outputs carry them


@dataclass(frozen=True, slots=True)
class Replayed:
    """A vLLM check output in the shape check_outputs reads from Ponytail's RequestOutput."""
    token_ids: list[int]
    outputs: list[_Completion]


def llm_args_for(peer: str, model) -> dict:
    """The LLM arguments of a peer. The model object is handed to LLM here, where LLM's defaults
    leave it eager and unfused; "ponytail" gets what `LLM(dir)` chooses when it loads the model
    itself (compile_model, fuse_projections and column_major_weights on CUDA), then the peer's own arguments."""
    base, own = parse_peer(peer)
    own = {k: v for k, v in own.items() if not k.startswith((LAUNCH_PREFIX, INDUCTOR_PREFIX))}  # see peer_launch
    compiled = VARIANTS[base]
    on_cuda = next(model.parameters()).device.type == "cuda"
    if compiled is None:
        compiled = on_cuda and can_compile(model)
    tuning = {"fuse_projections": on_cuda and can_fuse(model), "column_major_weights": on_cuda and can_compile(model),
              **own.pop("tuning", {})}
    return {"compile_model": compiled, "tuning": tuning, **own}


def restore_model(model) -> None:
    """The next peer gets the model as loaded: LLM compiled its layers, fused its projections and laid
    their weights out column-major in place."""
    restore_decoder_layers(model)
    unfuse_projections(model)
    row_major_weights(model)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def ponytail_start(model_arg: str, first_prompt: list[int], dtype) -> tuple[dict, object, object]:
    """Seconds from `LLM(dir)` (loading included) to ready and to the first token of one request;
    returns the loaded (model, tokenizer) for the rest of the run."""
    t0 = time.perf_counter()
    llm = ponytail.LLM(model_arg, dtype=dtype)
    ready = time.perf_counter()
    llm.generate([first_prompt], greedy(1))
    sync()
    first = time.perf_counter()
    model, tokenizer = llm.engine.model, llm.engine.tokenizer
    ceiling = pool_ceiling_bytes(llm)  # a fresh process's: a user's
    restore_model(model)  # LLM compiled and fused it in place; each peer decides for itself
    del llm
    gc.collect()
    return ({"llm_to_ready_s": ready - t0, "llm_to_first_token_s": first - t0, "kv_pool_ceiling_bytes": ceiling},
            model, tokenizer)


def pool_ceiling_bytes(llm) -> int:
    """The most the engine's KV pool may hold: its whole chunks within the budget."""
    cache = llm.engine.cache
    return cache.max_blocks * cache.config.block_bytes


def check_ponytail(model, tokenizer, prompts, steps, llm_args: dict):
    def generate(batch, params):  # builds, runs and drops its engine, as check_outputs asks
        sized = {"max_num_seqs": len(batch), "max_model_len": max(len(p) for p in batch) + steps}
        if "max_num_batched_tokens" in llm_args:  # LLM refuses a budget below max_num_seqs
            sized["max_num_seqs"] = min(len(batch), llm_args["max_num_batched_tokens"])
        llm = ponytail.LLM(model, tokenizer=tokenizer, **{**llm_args, **sized})
        try:
            return llm.generate(batch, params)
        finally:
            restore_model(model)

    return check_outputs(model, prompts, steps, generate)


def check_vllm(model, prompts, steps, checked: list[dict]):
    """vLLM's tokens (already generated, with top logprobs) judged like Ponytail's."""
    replayed = [Replayed(c["token_ids"], [_Completion([{int(t): v for t, v in step.items()} for step in c["logprobs"]])])
                for c in checked]
    return check_outputs(model, prompts, steps, lambda batch, params: replayed)


def verdict_line(peer: str, verdict) -> str:
    if not verdict.checked:
        return f"{peer}: output check skipped (--check-tokens 0): its speeds are not backed by a correctness check"
    side = verdict.ponytail
    line = (f"{peer}: output check {'PASS' if verdict.passed else 'FAIL'}: {side.exact_steps}/"
            f"{verdict.requests * verdict.steps} the fp32 reference's top token, {len(side.near_ties)} near ties "
            f"(within {verdict.tolerance:.3g} logits), {len(side.wrong)} wrong")
    for flip in side.wrong[:3]:
        line += (f"\n  WRONG: request {flip.row} step {flip.step}: chose {flip.chosen}, the reference's best "
                 f"{flip.best} is {flip.gap:.3g} logits higher")
    return line


def device_memory(model) -> dict | None:
    """What the device holds now, in the terms the KV budget subtracts (kv/budget.py): the weights,
    torch's other live tensors, its cached blocks (counted as free) and what lies outside torch (the
    CUDA context, libraries' modules and workspaces, other processes). None off CUDA."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"total": total, "free": free, "weights": weights, "other_tensors": allocated - weights,
            "torch_cached": reserved - allocated, "outside_torch": total - free - reserved}


def largest_live_tensors(model, device_type: str, top: int = 4) -> list[dict]:
    """The live tensors on `device_type` that Python holds besides the model's parameters, by shape
    and dtype, largest first, each storage counted once (as its largest view): what device_memory's
    "other tensors" are, where Python can see them (CUDA graph pools and C++ caches it cannot)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}  # data pointer -> (elements, shape, dtype, bytes) of its largest view
    for obj in gc.get_objects():
        # torch.compile leaves fake tensors alive: no memory of their own, and a data pointer that
        # warns (0) or raises (a peer stopped there once)
        if not isinstance(obj, torch.Tensor) or isinstance(obj, FakeTensor) or obj.device.type != device_type:
            continue
        try:
            storage = obj.untyped_storage()
            pointer = storage.data_ptr()
        except (NotImplementedError, RuntimeError):  # no storage to read (opaque tensors, e.g. mkldnn)
            continue
        if pointer not in weights and obj.numel() >= storages.get(pointer, (-1,))[0]:
            dtype = str(obj.dtype).removeprefix("torch.")
            storages[pointer] = (obj.numel(), tuple(obj.shape), dtype, storage.nbytes())
    total, count = {}, {}
    for _, shape, dtype, nbytes in storages.values():
        total[shape, dtype] = total.get((shape, dtype), 0) + nbytes
        count[shape, dtype] = count.get((shape, dtype), 0) + 1
    largest = sorted(total, key=total.get, reverse=True)[:top]
    return [{"shape": list(shape), "dtype": dtype, "bytes": total[(shape, dtype)], "tensors": count[(shape, dtype)]}
            for shape, dtype in largest]


@contextlib.contextmanager
def ponytail_engine(model, tokenizer, kv_memory, warmup, llm_args: dict, memory_before: dict | None = None):
    """A fresh engine with Ponytail's defaults but llm_args, after a short unrelated request; the
    model is given back as loaded after it. memory_before: filled with device_memory() as the engine
    found it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if memory_before is not None:
        memory_before.update(device_memory(model) or {})
        if memory_before:  # on CUDA: name the largest of the other tensors too
            memory_before["largest_other_tensors"] = largest_live_tensors(model, "cuda")
    llm = ponytail.LLM(model, tokenizer=tokenizer, **{"kv_cache_memory": kv_memory, **llm_args})
    try:
        llm.generate([warmup], greedy(2))
        sync()
        yield llm
    finally:
        restore_model(model)


def run_ponytail(model, tokenizer, work, kv_memory, warmup, llm_args: dict) -> dict:
    """One workload on a fresh engine (see ponytail_engine), timed."""
    memory_before = {}
    with ponytail_engine(model, tokenizer, kv_memory, warmup, llm_args, memory_before) as llm:
        t0 = time.perf_counter()
        outputs = llm.generate(work.prompts, [greedy(n) for n in work.output_lens])
        sync()
        seconds = time.perf_counter() - t0
    config = llm.engine.cache.config
    failed = [o for o in outputs if o.error is not None or o.metrics.first_token_time is None]
    if failed:  # a number over requests that did not run would be no measurement
        raise RuntimeError(f"{len(failed)} of {len(outputs)} requests failed ({llm_args}); the first: "
                           f"{failed[0].error or failed[0].finish_reason}")
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    need = (work.prompt_tokens + work.output_tokens) * config.bytes_per_token + len(work.prompts) * config.block_bytes
    result = {"seconds": seconds, "output_tokens": sum(len(o.token_ids) for o in outputs),
              "prompt_tokens": work.prompt_tokens, "ttfts": sorted(ttfts),
              "kv_pool_peak_bytes": llm.engine.cache.peak_allocated_bytes, "kv_all_requests_need_bytes": need,
              "kv_pool_ceiling_bytes": pool_ceiling_bytes(llm),
              "preemptions": llm.stats().num_preemptions, "device_memory_before": memory_before or None}
    del llm, outputs
    return result


def profile_ponytail(model, tokenizer, work, kv_memory, warmup, llm_args: dict) -> dict:
    """One workload on a fresh engine under kernel_time.recorded: its summary."""
    device = next(model.parameters()).device.type
    with ponytail_engine(model, tokenizer, kv_memory, warmup, llm_args) as llm, kernel_time.recorded(device) as summary:
        llm.generate(work.prompts, [greedy(n) for n in work.output_lens])
    return summary


def rates(result: dict) -> dict:
    """Adds tokens/s and TTFT percentiles to a side's raw result."""
    seconds = result["seconds"]
    ttfts = result.pop("ttfts", [])
    return {**result, "output_tokens_per_s": result["output_tokens"] / seconds,
            "prompt_tokens_per_s": result["prompt_tokens"] / seconds,
            "ttft_p50": percentile(ttfts, 0.5), "ttft_p99": percentile(ttfts, 0.99)}


def round_line(peer: str, work, result: dict) -> str:
    """One round as it lands, so that a run stopped early still shows what it measured."""
    rate = result[f"{work.metric}_tokens"] / result["seconds"]
    line = f"{peer} {work.name}: {rate:,.1f} {work.metric} tokens/s"
    if "kv_pool_ceiling_bytes" in result:  # Ponytail's pool; vLLM reserves its own up front
        peak, ceiling = result["kv_pool_peak_bytes"] / 1e9, result["kv_pool_ceiling_bytes"] / 1e9
        line += f" (KV pool peak {peak:.2f} of {ceiling:.2f} GB, {result['preemptions']} preemptions)"
    return line


def save_report(path: str | None, report: dict) -> None:
    """The report so far: written after every workload, so that a run stopped early keeps its rounds."""
    if path:
        Path(path).write_text(json.dumps(report, indent=2))


def median_run(runs: list[dict], metric: str) -> dict:
    """The run with the median tokens/s (the lower of two middles), every round's tokens/s under
    "rounds" in the order they ran."""
    key = f"{metric}_tokens_per_s"
    ordered = sorted(runs, key=lambda r: r[key])
    return {**ordered[(len(runs) - 1) // 2], "rounds": [r[key] for r in runs]}


def model_shape(model_dir: str) -> tuple[int, int]:
    """(vocab size, positions) from the checkpoint's config, without loading weights."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True).get_text_config()
    return config.vocab_size, int(getattr(config, "max_position_embeddings", 2048))



def add_arguments(parser) -> None:
    """bench_engine's flags for this mode."""
    side = parser.add_argument_group("side by side with vLLM (benchmarks/peer_bench.py)")
    side.add_argument("--workload", default="fixed",
                      help=f"one or more of {', '.join(peer_workloads.WORKLOADS)} (comma-separated), or all; "
                           f"fixed: --requests/--prompt-len/--output-len; the others: see peer_workloads.py")
    side.add_argument("--model", help="checkpoint directory both engines load (random_checkpoint.py builds one)")
    side.add_argument("--dtype", help="both engines' dtype (default: each one's own, bf16 on CUDA)")
    side.add_argument("--seed", type=int, default=0, help="seeds the workloads' lengths and token ids")
    side.add_argument("--vllm-python", default=sys.executable, help="interpreter vLLM runs under")
    side.add_argument("--vllm-pythonpath", default=os.environ.get("VLLM_PYTHONPATH"),
                      help="PYTHONPATH of vLLM's process (default: $VLLM_PYTHONPATH; ours is never passed on)")
    side.add_argument("--vllm-timeout", type=float, default=3600.0, help="seconds vLLM's whole run may take")
    side.add_argument("--vllm-workdir", help="where vLLM's request, results and log go (default: a temp dir)")
    side.add_argument("--profile", default="",
                      help="workloads (comma-separated) each engine runs once more under torch.profiler after the "
                           "timing: device time by kind of kernel, side by side (kernel_time.py)")
    side.add_argument("--vllm-reuse", action="store_true",
                      help="take vLLM's results from --vllm-workdir (an earlier run on the same requests)")


def side_by_side(parser, args, peers: list[str]) -> bool:
    """Whether bench_engine runs this mode (vllm among the peers, a workload other than fixed,
    --model, or a peer with LLM arguments); refuses what the mode cannot run. args.workload becomes
    a list of names."""
    workloads = list(peer_workloads.WORKLOADS) if args.workload == "all" else args.workload.split(",")
    if not workloads or set(workloads) - set(peer_workloads.WORKLOADS):
        parser.error(f"--workload {args.workload!r}: allowed: {', '.join(peer_workloads.WORKLOADS)} "
                     f"(comma-separated), or all")
    args.workload = workloads
    args.profile = [w for w in args.profile.split(",") if w]
    if set(args.profile) - set(workloads):
        parser.error(f"--profile {','.join(args.profile)}: expected workloads of --workload ({','.join(workloads)})")
    if not ("vllm" in peers or workloads != ["fixed"] or args.model or any(":" in p for p in peers)):
        return False
    in_process = sorted(set(peers) & {"plain", "generate_batch"})
    if in_process or args.capacity:
        parser.error(f"--peers {','.join(in_process) or '-'} / --capacity: only with --workload fixed, no "
                     f"--model and no vllm peer (the side-by-side mode runs ponytail, ponytail_eager, "
                     f"ponytail_compiled, vllm)")
    if args.vllm_reuse and not args.vllm_workdir:
        parser.error("--vllm-reuse needs --vllm-workdir (where the earlier run left vLLM's results)")
    if args.check_tokens < 0:
        parser.error(f"--check-tokens {args.check_tokens}: expected 0 (skip the check) or more")
    return True


def run(args, peers: list[str]) -> int:
    model_dir = args.model
    if model_dir is None:
        from ponytail.models.loader import default_checkpoint

        model_dir = str(default_checkpoint())
    vocab, max_len = model_shape(model_dir)
    try:
        workloads = peer_workloads.build_all(args.workload, vocab, max_len, seed=args.seed, small=args.small,
                                             fixed=(4, 32, 16) if args.small else
                                             (args.requests, args.prompt_len, args.output_len))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    check = peer_workloads.check_prompts(vocab, requests=2 if args.small else 4, seed=args.seed)
    warmup = peer_workloads.check_prompts(vocab, requests=1, length=8, seed=args.seed + 1)[0]
    report = {"model": model_dir, "workloads": {w.name: {"requests": len(w.prompts), "prompt_tokens": w.prompt_tokens,
                                                         "output_tokens": w.output_tokens} for w in workloads},
              "start": {}, "check": {}, "results": {}, "skipped": {}, "profiles": {}}

    rounds = args.rounds or 1
    vllm = None
    if "vllm" in peers:  # first: before this process holds any device memory
        # The dtype Ponytail will run in (its default: bf16 on CUDA, fp32 on the CPU), not the config's.
        dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
        request = {"model": model_dir, "dtype": dtype, "seed": 0, "warmup": warmup, "rounds": rounds,
                   "engine_args": getattr(args, "vllm_engine_args", {}),
                   "check": {"prompts": check, "steps": args.check_tokens},
                   "workloads": [w.to_json() for w in workloads], "profile": args.profile}
        workdir = Path(args.vllm_workdir or tempfile.mkdtemp(prefix="bench-vllm-"))
        if args.vllm_reuse:  # an earlier run's results, on the same requests (checked below)
            vllm = read_results(workdir)
            held = {r["name"]: r["prompt_tokens"] for r in vllm.get("results", [])}
            same = held == {w.name: w.prompt_tokens for w in workloads} and len(vllm.get("check", [])) == len(check)
            if vllm["ok"] and not same:
                vllm = {"ok": False, "error": f"--vllm-reuse: {workdir} holds other workloads or check requests"}
        else:
            vllm = run_vllm(args.vllm_python, args.vllm_pythonpath, request, workdir, args.vllm_timeout)
        if not vllm["ok"]:
            print(f"vllm: skipped: {vllm['error']}")
            report["skipped"]["vllm"] = vllm["error"]
            vllm = None
            if peers == ["vllm"]:
                return 1  # nothing left to run

    start, model, tokenizer = ponytail_start(model_dir, workloads[0].prompts[0], args.dtype)
    report["start"]["ponytail"] = start
    print(f"ponytail: LLM(dir) to first token {start['llm_to_first_token_s']:.1f} s, KV pool ceiling "
          f"{start['kv_pool_ceiling_bytes'] / 1e9:.2f} GB", flush=True)
    verdicts = {}
    ours = [p for p in peers if p != "vllm"]
    for peer in ours:
        with peer_launch(peer):
            verdicts[peer] = check_ponytail(model, tokenizer, check, args.check_tokens, llm_args_for(peer, model))
    if vllm is not None:
        report["start"]["vllm"] = vllm["start"]
        report["vllm"] = {"version": vllm["version"], "kv": vllm["kv"], "log": vllm["log"],
                          "engine_args": getattr(args, "vllm_engine_args", {})}
        if report["vllm"]["engine_args"]:
            print(f"vllm: LLM arguments {report['vllm']['engine_args']}", flush=True)
        verdicts["vllm"] = check_vllm(model, check, args.check_tokens, vllm["check"])
    for peer, verdict in verdicts.items():
        print(verdict_line(peer, verdict))
        report["check"][peer] = verdict.to_dict()
        # FP8 KV is lossy by design: its tokens may leave the fp32 reference's near ties; its accuracy is
        # measured on real weights (fp8_accuracy.py), so a miss here is reported, and the peer still timed.
        lossy = str((getattr(args, "vllm_engine_args", {}) if peer == "vllm" else parse_peer(peer)[1]).get(
            "kv_cache_dtype", "auto")).startswith("fp8")
        if not verdict.passed and lossy:
            print(f"{peer}: FP8 KV, lossy: its check is reported, not required", flush=True)
        elif not verdict.passed:
            print(f"{peer} produces wrong tokens: not timed", file=sys.stderr)
            return 1

    if vllm is not None:
        print(f"vllm: LLM() to first token {vllm['start']['llm_to_first_token_s']:.1f} s", flush=True)
        for w in workloads:
            for r in (r for r in vllm["results"] if r["name"] == w.name):
                print(round_line("vllm", w, r), flush=True)
        report["results"]["vllm"] = {w.name: median_run([rates(r) for r in vllm["results"] if r["name"] == w.name],
                                                        w.metric) for w in workloads}
        save_report(args.json, report)
    for peer in ours:
        llm_args = llm_args_for(peer, model)
        report["results"][peer] = {}
        for w in workloads:  # each printed as it lands: a run cut short keeps what it measured
            runs = []
            for _ in range(rounds):
                with peer_launch(peer):
                    runs.append(rates(run_ponytail(model, tokenizer, w, args.kv_memory, warmup, llm_args)))
                print(round_line(peer, w, runs[-1]), flush=True)
            report["results"][peer][w.name] = median_run(runs, w.metric)
            save_report(args.json, report)
    if vllm is not None and args.profile:
        report["profiles"]["vllm"] = vllm.get("profiles", {})
    for peer in ours:
        for w in (w for w in workloads if w.name in args.profile):
            with peer_launch(peer):
                profile = profile_ponytail(model, tokenizer, w, args.kv_memory, warmup, llm_args_for(peer, model))
            report["profiles"].setdefault(peer, {})[w.name] = profile
    print_table(report, workloads)
    print_profiles(report["profiles"], args.profile)
    save_report(args.json, report)
    return 0


def print_table(report: dict, workloads) -> None:
    engines = list(report["results"])
    ours = [e for e in engines if e != "vllm"]
    table = Table(title=f"tokens/s (output; prompt for prefill), {report['model']}")
    table.add_column("workload")
    for engine in engines:
        table.add_column(engine, justify="right")
    if "vllm" in engines:
        for engine in ours:
            table.add_column(f"{engine} / vllm", justify="right")
    for work in workloads:
        key = f"{work.metric}_tokens_per_s"
        values = {e: report["results"][e][work.name][key] for e in engines}
        cells = [f"{values[e]:,.1f}" for e in engines]
        if "vllm" in engines:
            cells += [f"{values[e] / values['vllm']:.2f}x" for e in ours]
        table.add_row(f"{work.name} ({len(work.prompts)} req, {work.prompt_tokens:,} in, {work.output_tokens:,} out)",
                      *cells)
    start = report["start"]
    cells = [f"{start[e]['llm_to_first_token_s']:.1f} s" if e in start else "-" for e in engines]
    if "vllm" in engines:
        cells += [f"{start['vllm']['llm_to_first_token_s'] / start[e]['llm_to_first_token_s']:.2f}x"
                  if e in start else "-" for e in ours]  # timed for LLM's defaults ("ponytail") only
    table.add_row("LLM() to first token (ratio: vllm's time / ours)", *cells)
    console = Console(width=max(Console().width, 120))
    console.print(table)
    if "vllm" in start:
        v = start["vllm"]
        kv = report["vllm"]["kv"]
        console.print(f"vllm {report['vllm']['version']}: process start to ready {v['process_to_ready_s']:.1f} s, to "
                      f"first token {v['process_to_first_token_s']:.1f} s; reserved KV "
                      f"{kv.get('reserved_gib_logged')} GiB ({kv.get('tokens_logged')} tokens, "
                      f"{kv.get('num_gpu_blocks')} blocks of {kv.get('block_size')})")
        for line in kv.get("memory_lines", []):
            console.print(f"  vllm log: {line}", markup=False)
    print_rounds(console, report, workloads)
    for engine in ours:
        for name, r in report["results"][engine].items():
            console.print(f"{engine} {name}: KV pool peak {r['kv_pool_peak_bytes'] / 1e9:.2f} GB of a "
                          f"{r['kv_pool_ceiling_bytes'] / 1e9:.2f} GB ceiling (all requests at once "
                          f"would need {r['kv_all_requests_need_bytes'] / 1e9:.2f} GB); preemptions "
                          f"{r['preemptions']}; TTFT p50 {r['ttft_p50']:.3f} s")
            if memory := r.get("device_memory_before"):
                gb = {k: memory[k] / 1e9 for k in ("total", "weights", "other_tensors", "torch_cached",
                                                   "outside_torch", "free")}
                console.print(f"  device before its engine: {gb['total']:.2f} GB, weights {gb['weights']:.2f}, other "
                              f"tensors {gb['other_tensors']:.2f}, torch's cache {gb['torch_cached']:.2f} (counted "
                              f"free), outside torch {gb['outside_torch']:.2f}, free {gb['free']:.2f}")
                largest = memory.get("largest_other_tensors") or []
                console.print("  largest other tensors: " + (", ".join(
                    f"{t['shape']} {t['dtype']} x{t['tensors']} {t['bytes'] / 1e9:.3f} GB" for t in largest) or "none"))


def print_rounds(console, report: dict, workloads) -> None:
    """With --rounds: each engine's rounds and their spread, and the ratio's range over every
    pairing of our rounds with vLLM's (a ratio inside its engines' spread is no difference)."""
    results = report["results"]
    if all(len(r.get("rounds", [])) < 2 for by_work in results.values() for r in by_work.values()):
        return
    for work in workloads:
        parts = []
        for engine, by_work in results.items():
            values = by_work[work.name]["rounds"]
            median = by_work[work.name][f"{work.metric}_tokens_per_s"]
            parts.append(f"{engine} {' / '.join(f'{v:,.0f}' for v in values)} "
                         f"(spread {(max(values) - min(values)) / median:.1%})")
        line = f"{work.name} rounds: " + "; ".join(parts)
        if "vllm" in results:
            theirs = results["vllm"][work.name]["rounds"]
            for engine in (e for e in results if e != "vllm"):
                mine = results[engine][work.name]["rounds"]
                line += (f"; {engine} / vllm {min(mine) / max(theirs):.3f}x to {max(mine) / min(theirs):.3f}x "
                         "over every pairing")
        console.print(line, soft_wrap=True)  # one line whatever its numbers' widths (never wrapped mid-phrase)


def print_profiles(profiles: dict, names: list[str], top: int = 8) -> None:
    """Per profiled workload: each engine's device time by kind of kernel, then its top kernels."""
    console = Console(width=max(Console().width, 120))
    for name in names:
        engines = [e for e in profiles if name in profiles[e]]
        if not engines:
            continue
        table = Table(title=f"{name}: device time by kind of kernel, seconds (one profiled run each)")
        table.add_column("kind")
        for engine in engines:
            table.add_column(engine, justify="right")
        kinds = list(dict.fromkeys(k for e in engines for k in profiles[e][name]["by_kind_s"]))
        for kind in kinds:
            table.add_row(kind, *(f"{profiles[e][name]['by_kind_s'].get(kind, 0.0):.3f}" for e in engines))
        table.add_row("all kernels, summed", *(f"{profiles[e][name]['kernel_s']:.3f}" for e in engines))
        table.add_row("kernels launched", *(f"{profiles[e][name]['kernels']:,}" for e in engines))
        table.add_row("wall, profiled", *(f"{profiles[e][name]['wall_s']:.3f}" for e in engines))
        console.print(table)
        for engine in engines:
            for k in profiles[engine][name]["top"][:top]:
                console.print(f"  {engine} {name}: {k['seconds']:8.3f} s {k['calls']:8,} x {k['name'][:90]}")
