"""The served model name is where its tokenizer loads from, as vLLM serves its --model, so clients
that load a tokenizer by the served name (guidellm 0.8.1 takes /v1/models' first id and calls
AutoTokenizer.from_pretrained on it) work without tokenizer flags; the short name still works."""

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from transformers import AutoTokenizer

from deployments.app.local_server import local_server
from openai_support import served_openai  # noqa: E402
from deployments.app.replica import tokenizer_source

pytestmark = pytest.mark.network  # the default model
SHORT = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def served():
    with served_openai() as (replica, client, url):
        yield replica, client


def test_the_first_model_id_loads_the_engines_tokenizer(served):
    replica, client = served
    first, alias = client.models.list().data
    assert alias.id == SHORT and first.root == alias.root == first.id
    tokenizer = AutoTokenizer.from_pretrained(first.id)  # guidellm's resolve_tokenizer, offline
    assert tokenizer(PROMPT)["input_ids"] == replica.tokenizer(PROMPT)["input_ids"]
    assert client.models.retrieve(SHORT).id == SHORT


def test_both_names_are_served_and_answered_back(served):
    _, client = served
    first = client.models.list().data[0].id
    by_path = client.completions.create(model=first, prompt=PROMPT, max_tokens=4, temperature=0)
    by_short = client.completions.create(model=SHORT, prompt=PROMPT, max_tokens=4, temperature=0)
    assert by_path.choices[0].text == by_short.choices[0].text
    assert by_path.model == first and by_short.model == SHORT
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="other", prompt=PROMPT, max_tokens=1)
    assert f"this server serves {first!r} or {SHORT!r}" in info.value.body["message"]


def test_a_named_replica_serves_only_that_name(default_model):
    model, tokenizer = default_model
    with local_server(served_model_name="mine") as (replica, _):
        assert replica.info.model_id == "mine" and replica.info.aliases == []
        assert replica.info.root == tokenizer_source(tokenizer)


def test_tokenizer_source(tmp_path, default_model):
    _, tokenizer = default_model

    class Named:
        name_or_path = None

    assert tokenizer_source(tokenizer) == tokenizer.name_or_path  # the converted checkpoint, absolute
    named = Named()
    named.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert tokenizer_source(named) == "HuggingFaceTB/SmolLM2-135M-Instruct"  # a hub id stays whole
    (tmp_path / "m.gguf").write_bytes(b"")
    named.name_or_path = str(tmp_path / "m.gguf")
    assert tokenizer_source(named) is None  # AutoTokenizer cannot load a .gguf path
    assert tokenizer_source(None) is None
