"""`ponytail estimate`, run through main() the way the console script runs it."""

import json

import pytest
from transformers import LlamaConfig

from ponytail.cli import main

LLAMA_7B = ["--num-layers", "32", "--num-kv-heads", "32", "--head-dim", "128"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_from_flags(capsys):
    code, out, err = run(capsys, "estimate", *LLAMA_7B, "--max-batch-size", "8",
                         "--max-seq-len", "2048")
    assert (code, err) == (0, "")
    assert "float16 (2 bytes)" in out  # the default dtype
    assert "total:               8,589,934,592 bytes (8.6 GB, 8.0 GiB)" in out
    assert "gpu memory" not in out


def test_estimate_gpu_memory(capsys):
    code, out, _ = run(capsys, "estimate", *LLAMA_7B, "--max-seq-len", "2048",
                       "--gpu-memory", "80GiB", "--dtype", "bf16")
    assert code == 0
    assert "bfloat16 (2 bytes)" in out
    assert "holds 80 sequences of 2,048 tokens" in out


def test_estimate_json(capsys):
    code, out, _ = run(capsys, "estimate", *LLAMA_7B, "--max-seq-len", "2049",
                       "--max-batch-size", "8", "--gpu-memory", "80000000000", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["tokens_per_seq_rounded"] == 2064
    assert data["total_bytes"] == 524_288 * 2049 * 8
    assert data["total_bytes_blocks"] == 524_288 * 2064 * 8
    assert (data["gpu_memory"], data["max_concurrent_seqs"]) == (80 * 10**9, 73)
    assert data["dtype"] == "float16"


@pytest.fixture
def smol_dir(tmp_path):
    """A local model directory holding only a SmolLM2-shaped config.json (bf16, 9/3 heads)."""
    LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                num_hidden_layers=30, intermediate_size=1536, vocab_size=49152,
                max_position_embeddings=8192, dtype="bfloat16",
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("which", ["dir", "file"])
def test_estimate_from_model(capsys, smol_dir, which):
    path = smol_dir if which == "dir" else smol_dir / "config.json"
    code, out, err = run(capsys, "estimate", "--model", str(path), "--json")
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert (data["num_layers"], data["num_kv_heads"], data["head_dim"]) == (30, 3, 64)
    assert (data["dtype"], data["max_seq_len"], data["max_batch_size"]) == ("bfloat16", 8192, 1)
    assert data["total_bytes"] == 2 * 30 * 3 * 64 * 2 * 8192


def test_estimate_from_hand_written_config_json(capsys, tmp_path):
    """A config.json as hubs ship it: older torch_dtype key, no head_dim."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896,
        "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24,
        "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
    }))
    code, out, _ = run(capsys, "estimate", "--model", str(path), "--max-seq-len", "4096",
                       "--max-batch-size", "4", "--num-kv-heads", "2", "--dtype", "bfloat16")
    assert code == 0
    assert "24 layers x 2 KV heads x head_dim 64, bfloat16" in out
    assert "4 x 4,096 tokens" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-kv-heads", "9"], "num_kv_heads=9 does not match the model (LlamaForCausalLM): "
                                  "it has num_key_value_heads=3"),
        (["--num-layers", "32"], "num_layers=32 does not match the model (LlamaForCausalLM): "
                                 "it has num_hidden_layers=30"),
    ],
)
def test_model_flags_that_disagree(capsys, smol_dir, flags, message):
    code, out, err = run(capsys, "estimate", "--model", str(smol_dir), *flags)
    assert (code, out) == (2, "")
    assert err == f"ponytail: error: {message}\n"


def test_dtype_is_what_the_weights_load_as_not_a_contradiction(capsys, smol_dir):
    """LLM(dtype="float16") casts a bfloat16 checkpoint as it loads: the estimate follows --dtype."""
    code, out, err = run(capsys, "estimate", "--model", str(smol_dir), "--dtype", "float16", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["dtype"] == "float16"


def test_errors_exit_2_without_traceback(capsys, tmp_path):
    code, _, err = run(capsys, "estimate", *LLAMA_7B, "--max-seq-len", "2048",
                       "--gpu-memory", "lots")
    assert code == 2
    assert err.startswith("ponytail: error: gpu_memory='lots' is not a byte size; allowed: ")
    assert "Traceback" not in err

    code, _, err = run(capsys, "estimate", "--num-layers", "32")
    assert (code, err) == (2, "ponytail: error: estimate needs --num-kv-heads, --head-dim, "
                              "--max-seq-len, or --model PATH to take the shape from\n")

    code, _, err = run(capsys, "estimate", "--model", str(tmp_path / "nope"))
    assert code == 2
    assert "does not exist and is no hub id; allowed: a local model directory holding config.json" in err

    (tmp_path / "config.json").write_text('{"model_type": "not-a-model"}')
    code, _, err = run(capsys, "estimate", "--model", str(tmp_path))
    assert code == 2
    assert "model_type='not-a-model'" in err and "is not a model type" in err

    (tmp_path / "config.json").write_text("{not json")
    code, _, err = run(capsys, "estimate", "--model", str(tmp_path))
    assert code == 2 and "cannot read" in err


def test_usage_errors_exit_2(capsys):
    code, _, err = run(capsys, "estimate", "--num-layers", "many")
    assert code == 2
    assert "argument --num-layers: invalid int value: 'many'" in err
    code, _, err = run(capsys)
    assert code == 2 and "required: COMMAND" in err


def test_help_exits_0(capsys):
    code, out, _ = run(capsys, "estimate", "--help")
    assert code == 0 and "--gpu-memory" in out


GIB = 1 << 30


@pytest.fixture
def llama7b_dir(tmp_path):
    """Llama-2-7B's shape (6,738,415,616 parameters), its config saying float16."""
    path = tmp_path / "llama-7b"
    LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, dtype="float16",
                architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


def test_device_memory_sizes_the_pool_as_the_engine_does(capsys, llama7b_dir):
    code, out, err = run(capsys, "estimate", "--model", str(llama7b_dir), "--device-memory", "80GiB", "--json")
    assert (code, err) == (0, "")
    device = json.loads(out)["device"]
    weights = 6_738_415_616 * 2  # bfloat16, as LLM() loads on CUDA, whatever the config says
    # activations of the largest step (16,384 tokens: prompt chunks only), fp32 logits
    step = (64 << 20) + 16384 * (6 * 4096 + 3 * 11008) * 2 + 256 * 32000 * 4
    budget = int(0.9 * 80 * GIB) - weights  # the step fits in the 10% beside it
    assert budget < 80 * GIB - weights - step
    assert (device["num_parameters"], device["weight_bytes"], device["step_headroom"]) == (6_738_415_616, weights, step)
    assert device["kv_budget"] == budget and json.loads(out)["gpu_memory"] == budget
    block = 2 * 32 * 32 * 128 * 2 * 16
    assert (device["kv_blocks"], device["kv_tokens"]) == (budget // block, budget // block * 16)
    assert device["max_concurrency"] == pytest.approx(budget // block * 16 / 4096)
    assert json.loads(out)["dtype"] == "bfloat16"

    code, out, _ = run(capsys, "estimate", "--model", str(llama7b_dir), "--device-memory", "80GiB",
                       "--gpu-memory-utilization", "0.5", "--max-seq-len", "2048", "--dtype", "float16")
    assert code == 0
    assert "gpu_memory_utilization=0.5" in out and "float16 (2 bytes)" in out
    tokens = (40 * GIB - weights) // block * 16
    assert f"KV pool ceiling:     {(40 * GIB - weights) / 1e9:.1f} GB" in out
    assert f"{tokens:,} tokens in {tokens // 16:,} blocks" in out
    assert f"at once:             {tokens / 2048:.2f} sequences of 2,048 tokens" in out


def test_device_memory_matches_the_engines_own_sizing(monkeypatch, capsys, llama7b_dir):
    """The estimate equals kv_budget on a device that holds only the weights (mocked CUDA queries)."""
    import torch

    from ponytail.kv.budget import kv_budget, step_headroom

    code, out, _ = run(capsys, "estimate", "--model", str(llama7b_dir), "--device-memory", "80GiB",
                       "--max-num-seqs", "64", "--max-num-batched-tokens", "2048", "--json")
    device = json.loads(out)["device"]
    weights = device["weight_bytes"]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GIB - weights, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: weights)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: weights)
    headroom = step_headroom(LlamaConfig.from_pretrained(llama7b_dir), 2048, 64, 2)
    assert device["step_headroom"] == headroom
    assert device["kv_budget"] == kv_budget(None, torch.device("cuda", 0), None, headroom=headroom)


def test_the_estimate_leaves_room_for_the_larger_step(capsys, llama7b_dir):
    """`ponytail estimate --device-memory` sizes one step's activations as LLM() does on CUDA: for the
    prefill-only budget where it is the larger."""
    from ponytail.kv.budget import step_headroom

    config = LlamaConfig.from_pretrained(llama7b_dir)
    for flags, tokens in (((), 16384), (("--max-num-batched-tokens", "2048"), 2048),
                          (("--prefill-only-batched-tokens", "32768"), 32768)):
        _, out, _ = run(capsys, "estimate", "--model", str(llama7b_dir), "--device-memory", "80GiB", *flags, "--json")
        device = json.loads(out)["device"]
        assert device["step_headroom"] == step_headroom(config, tokens, 256, 2), flags
    code, _, err = run(capsys, "estimate", "--model", str(llama7b_dir), "--device-memory", "80GiB",
                       "--max-num-batched-tokens", "8192", "--prefill-only-batched-tokens", "4096")
    assert code == 2
    assert "prefill_only_batched_tokens=4096 must be >= max_num_batched_tokens=8192" in err


def test_parameters_are_counted_as_the_model_loads_them(tmp_path):
    """Tied embeddings once, biases and norms included: the count of a real instance of the model."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from ponytail.kv.capacity import count_parameters

    for config in (LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True),
                   Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False)):
        real = AutoModelForCausalLM.from_config(config)
        assert count_parameters(config) == sum(p.numel() for p in real.parameters())


@pytest.mark.network  # the default model
def test_device_memory_without_a_model_estimates_the_default_model(capsys, default_model):
    """What `serve run deployments/app.yaml` serves, counted as the loaded model counts."""
    code, out, err = run(capsys, "estimate", "--device-memory", "24GiB", "--json")
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert data["device"]["num_parameters"] == sum(p.numel() for p in default_model[0].parameters())
    assert (data["num_layers"], data["num_kv_heads"], data["head_dim"], data["dtype"]) == (30, 3, 64, "bfloat16")


def test_estimate_reads_a_hub_id_from_the_hub_cache(tmp_path, llama7b_dir):
    from hub_cache import build_hub_cache, run_offline

    build_hub_cache(tmp_path / "home" / "hub", llama7b_dir, repo_id="acme/llama-7b")
    script = ("import sys; from ponytail.cli import main; "
              "sys.exit(main(['estimate', '--model', 'acme/llama-7b', '--device-memory', '80GiB', '--json']))")
    device = json.loads(run_offline(script, tmp_path / "home"))["device"]
    assert device["num_parameters"] == 6_738_415_616
    missing = ("import sys; from ponytail.cli import main; sys.stderr = sys.stdout; "
               "sys.exit(0 if main(['estimate', '--model', 'acme/nothing-here']) == 2 else 1)")
    said = run_offline(missing, tmp_path / "home")
    assert said.startswith("ponytail: error: name_or_path='acme/nothing-here': this hub id is not in the hub cache")
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in said


@pytest.mark.parametrize(("argv", "message"), [
    (["--num-layers", "32", "--num-kv-heads", "8", "--head-dim", "128", "--max-seq-len", "4096",
      "--device-memory", "80GiB"], "--device-memory 80GiB needs --model: the weights it leaves room for are "
                                   "counted from the model's config"),
    (["--model", "{dir}", "--device-memory", "80GiB", "--gpu-memory", "60GiB"],
     "--gpu-memory 60GiB and --device-memory 80GiB were both given; allowed: one"),
    (["--model", "{dir}", "--gpu-memory-utilization", "0.8"],
     "--gpu-memory-utilization 0.8 needs --device-memory (the device's total memory it is a share of)"),
    (["--model", "{dir}", "--device-memory", "80GiB", "--gpu-memory-utilization", "1.5"],
     "gpu_memory_utilization=1.5 is not supported; allowed: a share of the device's total memory in (0, 1]"),
    (["--model", "{dir}", "--device-memory", "14GiB"],
     "device_memory=15.0 GB leaves no KV memory for this model: its weights take 13.5 GB and one step 2.0 GB; "
     "allowed: a larger device"),
    (["--model", "{dir}", "--device-memory", "lots"], "device_memory='lots' is not a byte size"),
    (["--model", "{dir}", "--device-memory", "80GiB", "--max-num-seqs", "0"],
     "--max-num-seqs 0 is not supported; allowed: an integer >= 1"),
    (["--model", "{dir}", "--device-memory", "80GiB", "--prefill-only-batched-tokens", "0"],
     "--prefill-only-batched-tokens 0 is not supported; allowed: an integer >= 1"),
    (["--model", "{dir}", "--revision", "v2"], "--revision v2 names a version of a hub id, but --model is '{dir}'; "
                                              "allowed: --revision with --model ORG/NAME"),
])
def test_device_flags_that_cannot_work_are_refused_by_name(capsys, llama7b_dir, argv, message):
    argv = [a.replace("{dir}", str(llama7b_dir)) for a in argv]
    code, out, err = run(capsys, "estimate", *argv)
    assert (code, out) == (2, "")
    assert err.startswith("ponytail: error: " + message.replace("{dir}", str(llama7b_dir)))
