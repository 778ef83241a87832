"""The benchmark scripts in their CPU-sized form, so they keep running (numbers on a CPU mean nothing;
what is checked is that each runs end to end and that its correctness checks passed)."""

from __future__ import annotations

import importlib
import json
import random
import re
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

ROOT = Path(__file__).resolve().parents[1]


def benchmark_module(name: str):
    """A module of benchmarks/ (they import each other as top-level modules), imported here."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def run_script(name: str, *args: str, timeout: int = 900) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


@pytest.mark.slow
def test_bench_engine_small_runs_every_peer_and_agrees_with_plain_generate(tmp_path):
    out = tmp_path / "engine.json"
    run_script("bench_engine.py", "--small", "--check-tokens", "8", "--capacity", "8MiB",
               "--capacity-max-len", "256", "--rounds", "2", "--json", str(out))
    report = json.loads(out.read_text())
    check = report["agreement"]["ponytail"]  # ponytail.bench.output_check, the check `ponytail bench` runs
    assert check["passed"] and check["ponytail"]["near_ties"] == check["ponytail"]["wrong"] == []
    assert check["ponytail"]["exact_steps"] == check["of"] == 4 * 8  # fp32 on the CPU: the reference's tokens
    peers = {r["peer"] for r in report["results"]}
    assert {"plain generate", "ponytail"} <= peers
    ours = next(r for r in report["results"] if r["peer"] == "ponytail")
    assert ours["tokens_per_s"] > 0 and ours["preemptions"] == 0
    plain = next(r for r in report["results"] if r["peer"] == "plain generate")
    assert len(ours["rounds"]) == len(plain["rounds"]) == 2  # alternating rounds, the median reported
    assert ours["tokens_per_s"] == sorted(ours["rounds"])[0]  # of two, the lower
    assert report["capacity"]["used_blocks_after"] == 0 and report["capacity"]["peak_running"] > 0
    chat = report["chat"]  # the seeded chat workload with long prompts: every step timed
    assert chat["long_prompts"] == 2 and chat["output_tokens"] > 0 and chat["steps"] > 0
    assert 0 < chat["step_p50"] <= chat["step_p99"] <= chat["step_max"]


def test_bench_attention_small_checks_against_sdpa(tmp_path):
    out = tmp_path / "attention.json"
    run_script("bench_attention.py", "--small", "--json", str(out))
    results = json.loads(out.read_text())["results"]
    assert {r["kind"] for r in results} == {"decode", "prefill"}
    assert all(r["rel_error"] < 2e-2 for r in results)


def test_bench_cache_ops_small_runs(tmp_path):
    out = tmp_path / "cache_ops.json"
    run_script("bench_cache_ops.py", "--small", "--json", str(out))
    assert json.loads(out.read_text())


@pytest.mark.slow
def test_bench_router_small_runs_both_routers_without_failures(tmp_path):
    out = tmp_path / "router.json"
    run_script("bench_router.py", "--small", "--long-per-burst", "1", "--loads", "2", "--json", str(out))  # exit 1: a failure
    report = json.loads(out.read_text())
    assert set(report["pooled"]) == {"kv_blocks", "power_of_two"}
    for against in (r["p99_vs_power_of_two"] for r in report["pooled"]["kv_blocks"].values()):
        assert against["ratio"] > 0 and 0 < against["interval_90"][0] <= against["interval_90"][1]
    for router, runs in report["runs"].items():
        assert [(r["round"], r["load"]) for r in runs] == [(0, 0), (0, 1)]  # two loads on one deployment
        assert report["pooled"][router]["0.5"]["requests"] == 2 * report["sizes"]["n"]
        for run in runs:
            assert isinstance(run["held"], list)  # the ingress router's holds, empty under power of two
            assert router != "power_of_two" or run["held"] == []
            assert sum(run["replica_requests"]) == report["sizes"]["n"]  # every request reached a replica
            assert sum(run["replica_steps"]) > 0 and all(0 < b < 1 for b in run["replica_busy"] if b)


@pytest.mark.slow
def test_bench_router_small_chat_compares_three_routers_with_their_prefix_hit_rates(tmp_path):
    out = tmp_path / "chat.json"
    run_script("bench_router.py", "--small", "--workload", "chat", "--json", str(out))  # exit 1: a failure
    report = json.loads(out.read_text())
    assert set(report["pooled"]) == {"prefix", "kv_blocks", "power_of_two"}
    chat = report["chat"]
    for router, runs in report["runs"].items():
        assert sum(runs[0]["replica_requests"]) == chat["sessions"] * chat["turns"]
        # Later turns extend earlier ones and system prompts are shared: every router hits some.
        assert 0 < runs[0]["prefix_hit_rate"] < 1, router
        assert sum(runs[0]["replica_prefix_hits"]) <= sum(runs[0]["replica_prompt_tokens"])


@pytest.mark.slow
def test_bench_router_records_how_long_the_ingress_router_held_each_request(tmp_path):
    """Through a running app: every burst brings 4 long prompts where the two pools hold one each,
    so some wait in the router; the ingress hands their waits out (OpenAIIngress.take_router_holds,
    read from the router's own module even though Serve ships the classes by value)."""
    out = tmp_path / "held.json"
    run_script("bench_router.py", "--small", "--long-per-burst", "4", "--long-per-replica", "1",
               "--routers", "kv_blocks", "--json", str(out))
    report = json.loads(out.read_text())
    held = report["runs"]["kv_blocks"][0]["held"]
    assert held and all(isinstance(replica, str) and blocks > 0 and seconds >= 0 for replica, blocks, seconds in held)
    assert report["pooled"]["kv_blocks"]["0.5"]["held"] == len(held)

def test_chat_sessions_share_system_prompts_and_differ_in_their_turns():
    chat_workload = benchmark_module("chat_workload")
    ChatShape, sessions = chat_workload.ChatShape, chat_workload.sessions
    shape = ChatShape(sessions=5, turns=3, system_prompts=2, system_words=50, user_words=10, max_tokens=8,
                      session_gap_s=0.1, think_s=0.1)
    chats = sessions(shape, seed=0)
    assert [c.system for c in chats[:2]] * 2 + [chats[0].system] == [c.system for c in chats]
    assert chats[0].system != chats[1].system and len(chats[0].system.split()) == 50 + 3
    assert all(len(c.users) == 3 for c in chats) and len({u for c in chats for u in c.users}) == 15
    assert sessions(shape, seed=0) == chats and sessions(shape, seed=1) != chats


def test_bench_router_workload_puts_exactly_long_per_burst_long_prompts_in_each_burst():
    workload = benchmark_module("bench_router").workload

    class Words:  # a tokenizer stand-in: one token per word
        def __call__(self, text, add_special_tokens=False):
            return type("Encoding", (), {"input_ids": list(range(len(text.split())))})()

    prompts = workload(Words(), 40, 0.25, 30, 5, seed=3, burst=16, long_per_burst=4)
    counts = [sum(len(p) == 30 for p in prompts[i:i + 16]) for i in range(0, 40, 16)]
    assert len(prompts) == 40 and counts == [4, 4, 4] and all(len(p) in (5, 30) for p in prompts)
    assert [len(p) for p in prompts[:16]] != [len(p) for p in prompts[16:32]]  # places differ per burst


def test_bench_router_compares_mean_ttft_load_by_load_against_the_same_rounds_baseline():
    mean_ttft_changes = benchmark_module("bench_router").mean_ttft_changes
    base = [{"round": 0, "load": 0, "gap": 0.1, "ttfts": [0.2, 0.4]}, {"round": 1, "load": 0, "gap": 0.1, "ttfts": [0.5]},
            {"round": 0, "load": 0, "gap": 1.0, "ttfts": [9.0]}, {"round": 0, "load": 1, "gap": 0.1, "ttfts": [0.1]}]
    runs = [{"round": 1, "load": 0, "gap": 0.1, "ttfts": [0.25, 0.5]},
            {"round": 0, "load": 0, "gap": 0.1, "ttfts": [0.15, 0.15]},
            {"round": 2, "load": 0, "gap": 0.1, "ttfts": [0.1]}, {"round": 0, "load": 0, "gap": 0.1, "ttfts": []},
            {"round": 0, "load": 1, "gap": 0.1, "ttfts": [0.2]}]  # against the same load of round 0
    assert mean_ttft_changes(runs, base, 0.1) == pytest.approx([-0.25, -0.5, 1.0])  # round 2 has no baseline
    assert mean_ttft_changes(runs, base, 1.0) == [] and mean_ttft_changes(runs, [], 0.1) == []


def test_bench_router_p99_ratio_interval_separates_real_gaps_from_one_slow_request():
    ratio_interval = benchmark_module("bench_router").ratio_interval
    rng = random.Random(0)
    base = [rng.uniform(0.1, 0.3) for _ in range(96)] + [1.0]  # one slow request makes the p99
    same = [rng.uniform(0.1, 0.3) for _ in range(96)] + [1.1]
    lo, hi = ratio_interval(same, base, q=0.99)
    assert lo < 1.0 < hi  # 10% higher at p99, and nothing separates the two
    steady = [rng.uniform(0.1, 0.3) for _ in range(200)]
    slower = [2 * t for t in steady]
    lo, hi = ratio_interval(slower, steady, q=0.99, seed=1)
    assert 1.0 < lo <= 2.0 <= hi  # twice as slow everywhere: the interval excludes 1
    assert ratio_interval(slower, steady, q=0.99, seed=1) == (lo, hi)  # seeded
    assert ratio_interval([], base, q=0.99) is None


def test_side_by_side_prints_each_round_with_its_pool_as_it_lands(tmp_path):
    """A lease may end mid-run: each round's line carries the pool's peak, ceiling and preemptions,
    and the JSON holds every workload finished so far (written after each)."""
    out = tmp_path / "peers.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--small", "--workload",
                             "prefill", "--peers", "ponytail,ponytail:kv_cache_memory=64MiB", "--check-tokens", "0",
                             "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("ponytail prefill: ")]
    assert re.fullmatch(r"ponytail prefill: [\d,]+\.\d prompt tokens/s \(KV pool peak \d+\.\d\d of \d+\.\d\d GB, "
                        r"0 preemptions\)", lines[0]), lines
    results = json.loads(out.read_text())["results"]
    ours = results["ponytail"]["prefill"]
    assert 0 < ours["kv_pool_peak_bytes"] <= ours["kv_pool_ceiling_bytes"]
    # a peer's own kv_cache_memory sizes its pool instead of --kv-memory
    small = results["ponytail:kv_cache_memory=64MiB"]["prefill"]
    assert small["kv_pool_ceiling_bytes"] <= 64 << 20 < ours["kv_pool_ceiling_bytes"]


def test_device_memory_splits_what_the_kv_budget_subtracts(monkeypatch):
    peer_bench = benchmark_module("peer_bench")
    model = torch.nn.Linear(4, 8, bias=False)  # 32 fp32 parameters: 128 bytes of weights
    assert peer_bench.device_memory(model) is None or torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (600, 2000))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1128)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 1300)
    assert peer_bench.device_memory(model) == {"total": 2000, "free": 600, "weights": 128, "other_tensors": 1000,
                                               "torch_cached": 172, "outside_torch": 100}


def test_largest_live_tensors_leaves_the_weights_out_and_counts_each_storage_once():
    peer_bench = benchmark_module("peer_bench")
    model = torch.nn.Linear(64, 64, bias=False)
    held = [torch.zeros(1000), torch.zeros(1000)]  # two of one shape: 8,000 bytes together
    also = torch.zeros(10, dtype=torch.float64)
    view = held[0][:10]  # the same storage as held[0]: not counted again
    opaque = torch.zeros(4, 4).to_mkldnn() if torch.backends.mkldnn.is_available() else None  # no storage: left out
    with FakeTensorMode():  # what torch.compile leaves alive: no memory, a data pointer that warns or raises
        fake = torch.zeros(3000)
    with warnings.catch_warnings():
        # reading the fake tensor's data pointer would warn (torch 2.13) or raise (2.11 on CUDA)
        warnings.filterwarnings("error", message=".*data pointer of FakeTensor")
        largest = peer_bench.largest_live_tensors(model, "cpu", top=50)
    mine = [t for t in largest if (t["shape"], t["dtype"]) in (([1000], "float32"), ([10], "float64"))]
    assert {"shape": [1000], "dtype": "float32", "bytes": 8000, "tensors": 2} in mine
    assert {"shape": [10], "dtype": "float64", "bytes": 80, "tensors": 1} in mine
    assert not any(t["shape"] == [64, 64] for t in largest)  # the weights
    assert not any(t["shape"] == [3000] for t in largest)  # the fake tensor
    assert largest == sorted(largest, key=lambda t: t["bytes"], reverse=True)
    del held, also, view, opaque, fake


def test_bench_engine_refuses_unknown_peers_before_loading_a_model():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--small",
                             "--peers", "plain,sglang"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert ("--peers: unknown ['sglang']; allowed: plain, generate_batch, ponytail, ponytail_compiled, "
            "ponytail_eager, vllm" in result.stderr)


def test_bench_engine_refuses_unknown_llm_arguments_of_a_peer_before_loading_a_model():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--small",
                             "--peers", "ponytail,ponytail:max_batch=3"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2
    assert ("--peers 'ponytail:max_batch=3': expected name=value with a name LLM takes; got 'max_batch=3' "
            "(allowed: async_scheduling, block_size," in result.stderr)
    parse_peer = benchmark_module("peer_bench").parse_peer
    with pytest.raises(ValueError, match="--peers 'vllm:max_num_seqs=8': LLM arguments go after one of ponytail, "
                                         "ponytail_eager, ponytail_compiled, not 'vllm'"):
        parse_peer("vllm:max_num_seqs=8")
    # a peer's own KV budget overrides --kv-memory (a pool sized as before, beside the default)
    assert parse_peer("ponytail:kv_cache_memory=59.1GB") == ("ponytail", {"kv_cache_memory": "59.1GB"})
    with pytest.raises(ValueError, match="got 'device=cpu'"):  # the benchmark sets it
        parse_peer("ponytail:device=cpu")
    with pytest.raises(ValueError, match="got 'cuda_graphs'"):
        parse_peer("ponytail:cuda_graphs")
    with pytest.raises(ValueError, match=r"decode.warps='8': expected decode.<key>=<int> with a key of "
                                         r"ponytail.attention.decode.LAUNCH \(decode_warps, "):
        parse_peer("ponytail:decode.warps=8")
    with pytest.raises(ValueError, match=r"decode.decode_warps='eight': expected decode.<key>=<int>"):
        parse_peer("ponytail:decode.decode_warps=eight")


def test_bench_engine_peer_arguments_are_yaml_scalars():
    parse_peer = benchmark_module("peer_bench").parse_peer
    assert parse_peer("ponytail_compiled") == ("ponytail_compiled", {})
    assert parse_peer("ponytail:max_num_batched_tokens=16384; prefill_delay_factor=0.5;cuda_graphs=false") == (
        "ponytail", {"max_num_batched_tokens": 16384, "cuda_graphs": False, "tuning": {"prefill_delay_factor": 0.5}})


def test_a_peers_decode_launch_overrides_hold_while_it_runs_and_not_after():
    peer_bench = benchmark_module("peer_bench")
    launch = peer_bench.decode_kernel.LAUNCH
    before = dict(launch)
    peer = "ponytail:decode.max_split_blocks=64;decode.decode_warps=8;cuda_graphs=false"
    assert peer_bench.parse_peer(peer)[1] == {"decode.max_split_blocks": 64, "decode.decode_warps": 8,
                                              "cuda_graphs": False}
    with peer_bench.peer_launch(peer):
        assert launch == {**before, "max_split_blocks": 64, "decode_warps": 8}
    assert launch == before
    with pytest.raises(RuntimeError), peer_bench.peer_launch(peer):
        raise RuntimeError("a peer that fails mid-run")
    assert launch == before


def test_a_peers_inductor_options_hold_while_it_runs_and_not_after():
    import torch._inductor.config as inductor_config

    peer_bench = benchmark_module("peer_bench")
    peer = "ponytail:inductor.triton.enable_pdl=true;inductor.max_autotune=false"
    assert peer_bench.parse_peer(peer)[1] == {"inductor.triton.enable_pdl": True, "inductor.max_autotune": False}
    assert "inductor.triton.enable_pdl" not in peer_bench.llm_args_for(peer, torch.nn.Linear(2, 2))
    before = inductor_config.triton.enable_pdl
    with peer_bench.peer_launch(peer):
        assert inductor_config.triton.enable_pdl is True
    assert inductor_config.triton.enable_pdl == before
    with pytest.raises(ValueError, match=r"inductor.triton.no_such_option='1': expected inductor.<option>=<value> "
                                         r"with an option of torch._inductor.config"):
        peer_bench.parse_peer("ponytail:inductor.triton.no_such_option=1")
    with pytest.raises(ValueError, match=r"inductor.triton.enable_pdl='2': expected inductor.<option>=<value> "
                                         r"with a bool, as its default False"):
        peer_bench.parse_peer("ponytail:inductor.triton.enable_pdl=2")


def test_bench_router_merge_pools_earlier_runs_as_one_with_each_files_rounds_apart(tmp_path):
    def load(router, round_index, ttfts):
        return {"round": round_index, "load": 0, "gap": 2.0, "requests": len(ttfts), "failed": 0, "errors": [],
                "tokens": 10 * len(ttfts), "seconds": 1.0, "tokens_per_s": 10.0 * len(ttfts), "ttfts": ttfts,
                "ttfts_long": ttfts[-1:], "ttft_p50": statistics.median(ttfts), "ttft_p99": max(ttfts),
                "held": [["r1", 3, 0.5]] if router == "prefix" else [], "replica_requests": [1, 1],
                "replica_prompt_tokens": [10, 10], "replica_prefix_hits": [0, 0], "prefix_hit_rate": 0.0,
                "preemptions": 0, "replica_steps": [1, 1], "replica_step_ms": [1.0, 1.0], "replica_busy": [0.5, 0.5],
                "admit_s": 0.0, "engine_ttft_s": 0.1, "engine_queue_s": 0.05}

    files = []
    for index, (fast, slow) in enumerate([([0.1] * 98 + [0.5] * 2, [0.1] * 98 + [1.0] * 2), ([0.2] * 100, [0.1] * 100)]):
        path = tmp_path / f"run{index}.json"
        path.write_text(json.dumps({"workload": "mix", "sizes": {"n": 100}, "chat": None, "gaps": [2.0],
                                    "runs": {"prefix": [load("prefix", 0, fast)],
                                             "power_of_two": [load("power_of_two", 0, slow)]}}))
        files.append(str(path))
    out = tmp_path / "merged.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_router.py"), "--merge", *files,
                             "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    merged = json.loads(out.read_text())
    assert [r["round"] for r in merged["runs"]["prefix"]] == [0, 1]  # the second file's round follows the first's
    prefix, p2c = merged["pooled"]["prefix"]["2.0"], merged["pooled"]["power_of_two"]["2.0"]
    assert (prefix["requests"], prefix["held"], prefix["ttft_p99"], p2c["ttft_p99"]) == (200, 2, 0.5, 1.0)
    assert "mean TTFT against power_of_two's same round and load, one by one: -8%, +100%" in result.stdout
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**json.loads(Path(files[0]).read_text()), "sizes": {"n": 7}}))
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_router.py"), "--merge", files[0],
                              str(other)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and f"--merge: {other} ran another workload or other sizes than {files[0]}" \
        in refused.stderr


def test_bench_router_refuses_unknown_routers_and_gaps_before_starting_ray():
    for args, message in ((["--routers", "kv_blocks,random"],
                           "--routers: unknown ['random']; allowed: kv_blocks, prefix, power_of_two, "
                           "kv_blocks_nohold, kv_blocks_per_token, app_default"),
                          (["--workload", "chat", "--sessions", "0"], "--sessions 0: expected 1 or more"),
                          (["--loads", "0"], "--loads 0: expected at least 1 load per gap"),
                          (["--gaps", "1.0,soon"], "--gaps '1.0,soon': expected seconds >= 0, comma-separated")):
        result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_router.py"), "--small", *args],
                                cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 2
        assert message in result.stderr


def test_bench_router_routers_carry_app_args_checked_against_the_apps_args():
    router_args = benchmark_module("bench_router").router_args
    assert router_args("prefix:prefill_delay_factor=0;compile_model=true") == {
        "router": "prefix", "api_in_engines": False, "prefill_delay_factor": 0, "compile_model": True}
    assert router_args("prefix@0.5:max_num_seqs=32") == {
        "router": "prefix", "api_in_engines": False, "prefix_weight": 0.5, "max_num_seqs": 32}
    assert router_args("power_of_two") == {"router": "power_of_two", "api_in_engines": False}
    assert router_args("random:max_num_seqs=32") is None
    with pytest.raises(ValueError, match=r"--routers 'prefix:prefill_delay=0': expected key=value with an app arg "
                                         r"the benchmark does not set itself; got 'prefill_delay=0' \(allowed: .*"
                                         r"prefill_delay_factor"):
        router_args("prefix:prefill_delay=0")
    with pytest.raises(ValueError, match="got 'kv_cache_memory=1000'"):  # the benchmark sizes the pool itself
        router_args("kv_blocks:kv_cache_memory=1000")
    # flat on the command line, nested as the app takes them: LLM's under engine, tuning's under its tuning
    nested = benchmark_module("serve_args").nested
    assert nested({"router": "prefix", "max_num_seqs": 8, "prefill_delay_factor": 0, "num_gpus": 0.5}) == {
        "router": "prefix", "num_gpus": 0.5, "engine": {"max_num_seqs": 8, "tuning": {"prefill_delay_factor": 0}}}


@pytest.mark.network
def test_bench_structured_small_runs_both_batches_to_the_same_length(tmp_path):
    pytest.importorskip("xgrammar")
    out = tmp_path / "structured.json"
    run_script("bench_structured.py", "--small", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["constrained"] == 2 and report["requests"] == 4
    assert report["runs"]["free"][0]["tokens"] == report["runs"]["mixed"][0]["tokens"] == 4 * 16


@pytest.mark.gpu
@pytest.mark.network
def test_bench_structured_runs_both_batches_to_the_same_length_on_the_gpu(tmp_path):
    """Its speed ratio is the benchmark's to print (docs/benchmarks.md), not a test's to assert."""
    pytest.importorskip("xgrammar")
    out = tmp_path / "structured.json"
    run_script("bench_structured.py", "--json", str(out))
    report = json.loads(out.read_text())
    free, mixed = report["runs"]["free"], report["runs"]["mixed"]
    assert [run["tokens"] for run in free] == [run["tokens"] for run in mixed] and free[0]["tokens"] > 0
    assert report["ratio"] > 0


