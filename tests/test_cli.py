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
        (["--dtype", "float16"], "dtype=float16 does not match the model (LlamaForCausalLM): "
                                 "its config has dtype bfloat16"),
        (["--num-layers", "32"], "num_layers=32 does not match the model (LlamaForCausalLM): "
                                 "it has num_hidden_layers=30"),
    ],
)
def test_model_flags_that_disagree(capsys, smol_dir, flags, message):
    code, out, err = run(capsys, "estimate", "--model", str(smol_dir), *flags)
    assert (code, out) == (2, "")
    assert err == f"ponytail: error: {message}\n"


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
    assert "does not exist; allowed: a local model directory holding config.json" in err

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
