"""The model's generation_config.json fills the sampling fields a request leaves unset (vLLM's
`--generation-config auto`); `generation_config: ponytail` keeps SamplingParams' own defaults."""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
try:
    import httpx2 as httpx  # the HTTP library openai>=3 depends on
except ImportError:  # pragma: no cover - older openai clients use httpx
    import httpx

import ponytail  # noqa: E402
from deployments.api.generation_defaults import model_sampling_defaults  # noqa: E402
from deployments.api.server import build_app  # noqa: E402
from deployments.app.local_server import serve_on_loopback  # noqa: E402
from deployments.app.replica import EngineReplica  # noqa: E402

RECOMMENDED = {"temperature": 0.3, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05}


def _config_dir(tmp_path, fields: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "do_sample": True, **fields}))
    return str(tmp_path)


def test_the_sampling_fields_the_file_sets_and_only_those(tmp_path):
    assert model_sampling_defaults(_config_dir(tmp_path, RECOMMENDED)) == RECOMMENDED
    assert model_sampling_defaults(_config_dir(tmp_path, {"temperature": 0.6})) == {"temperature": 0.6}
    assert model_sampling_defaults(None) == {} and model_sampling_defaults(str(tmp_path / "nowhere")) == {}


def test_a_value_sampling_params_refuses_is_left_out_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="deployments.api.generation_defaults"):
        assert model_sampling_defaults(_config_dir(tmp_path, {"temperature": -3, "top_p": 0.9})) == {"top_p": 0.9}
    assert "temperature=-3 is not used as a default (temperature=-3 is invalid" in caplog.text


@pytest.mark.network  # the default model's weights and tokenizer
@pytest.mark.parametrize("generation_config", ["auto", "ponytail"])
def test_the_replica_fills_unset_fields_from_the_models_file(default_model, tmp_path, generation_config):
    source = ponytail.models.loader.default_checkpoint()
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    for path in source.iterdir():  # the default model with a generation_config.json of our own
        if path.name != "generation_config.json":
            (checkpoint / path.name).symlink_to(path)
    _config_dir(checkpoint, RECOMMENDED)
    replica = EngineReplica(str(checkpoint), engine=dict(device="cpu", kv_cache_memory="16MiB", max_num_seqs=2,
                                                         max_model_len=128), generation_config=generation_config)
    used = []

    async def record(prompt, params, request_id, priority=0):
        used.append(params)
        return
        yield

    replica.async_llm.generate = record
    expected = RECOMMENDED if generation_config == "auto" else {}
    assert replica.info.sampling_defaults == expected  # what the API builds every request's SamplingParams over
    with serve_on_loopback(build_app(replica)) as url:  # the API: no Ray
        for body in ({"max_tokens": 4}, {"max_tokens": 4, "temperature": 0.9, "top_k": 5}):
            httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], **body}, timeout=60)
    unset, set_ = used
    plain = ponytail.SamplingParams()
    if generation_config == "auto":
        assert {name: getattr(unset, name) for name in RECOMMENDED} == RECOMMENDED
        assert (set_.temperature, set_.top_k, set_.top_p) == (0.9, 5, 0.8)  # the request's own win
    else:
        assert {name: getattr(unset, name) for name in RECOMMENDED} == {name: getattr(plain, name) for name in RECOMMENDED}
        assert (set_.temperature, set_.top_k, set_.top_p) == (0.9, 5, plain.top_p)
    # A handle caller builds its SamplingParams over the same defaults
    assert {name: getattr(replica.info.sampling_params(), name) for name in expected} == expected


def test_an_unknown_generation_config_is_refused_before_loading():
    with pytest.raises(ponytail.ConfigError, match="generation_config='vllm' is not supported; allowed: auto, ponytail"):
        EngineReplica(engine={"device": "cpu"}, generation_config="vllm")
