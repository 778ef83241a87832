"""The prefix router tokenizes chat and text prompts to hash their blocks; the ids travel with the
request, and a replica with the same tokenizer runs them instead of tokenizing a second time."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve")

import ponytail  # noqa: E402
from deployments.api.prompts import chat_token_ids, tokenizer_fingerprint  # noqa: E402
from deployments.api.protocol import GenerateRequest  # noqa: E402
from ponytail import SamplingParams  # noqa: E402
from deployments.app.replica import EngineReplica  # noqa: E402
from test_prefix_routing import BS, chat, make_router, prefixed  # noqa: E402
from test_router import FakeClock  # noqa: E402

pytestmark = pytest.mark.network  # the default model's tokenizer

MESSAGES = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return ponytail.load_tokenizer(None)


def test_the_router_sends_its_ids_with_the_tokenizers_fingerprint(tokenizer):
    router = make_router(FakeClock(), tokenizer=tokenizer)

    async def body():  # a PendingRequest is made inside a running loop
        pr = chat(MESSAGES)
        assert router.prompt_hashes(pr, BS) is not None
        fingerprint, ids = pr.args[0].tokenized
        assert fingerprint == tokenizer_fingerprint(tokenizer) and len(fingerprint) == 64
        assert ids == chat_token_ids(tokenizer, MESSAGES)
        token_prompt = prefixed()
        router.prompt_hashes(token_prompt, BS)
        assert token_prompt.args[0].tokenized is None  # already ids: nothing to pass on

    asyncio.run(body())


def test_fingerprints_tell_tokenizers_apart(tokenizer):
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(ponytail.load_tokenizer(None))
    other = ponytail.load_tokenizer(None)
    other.chat_template = "{{ messages[0]['content'] }}"
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tokenizer)
    assert tokenizer_fingerprint(object()) is None  # no fast tokenizer: never shared

    class Opaque:
        class backend_tokenizer:  # noqa: N801 (the attribute a fast tokenizer has)
            @staticmethod
            def to_str():
                raise RuntimeError("not serializable")

    assert tokenizer_fingerprint(Opaque()) is None


@pytest.mark.parametrize("same_tokenizer", [True, False])
def test_a_replica_runs_the_routers_ids_only_from_its_own_tokenizer(default_model, tokenizer, same_tokenizer):
    replica = EngineReplica(engine=dict(device="cpu", kv_cache_memory="64MiB", max_num_seqs=4, max_model_len=512))
    own = chat_token_ids(tokenizer, MESSAGES)
    given = own[:-6]  # other ids than the messages': the ones that ran tell which source was used
    fingerprint = tokenizer_fingerprint(tokenizer) if same_tokenizer else "0" * 64
    request = GenerateRequest(messages=MESSAGES, sampling=SamplingParams(max_tokens=2, temperature=0),
                              request_id=f"tok-{same_tokenizer}", tokenized=(fingerprint, given))

    async def main():
        return [d async for d in replica.generate(request)]

    deltas = asyncio.run(main())
    assert deltas[-1].finished
    assert deltas[-1].prompt_tokens == (len(given) if same_tokenizer else len(own))
    assert replica.llm.stats().used_blocks == 0
