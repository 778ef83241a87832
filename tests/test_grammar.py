"""Structured outputs below the API: StructuredOutputsParams, the sampler's grammar mask, the engine.

The mask tests need no grammar library (bitmasks are built by hand); the engine tests compile
real schemas with xgrammar against the default model's tokenizer, with and without async
scheduling, constrained and free requests in the same steps.
"""

import json

import pytest
import torch

import ponytail
from ponytail import ConfigError, SamplingParams, StructuredOutputsParams
from ponytail.sampling.grammar import bitmask_words
from ponytail.sampling.sampler import SamplingBatch, request_generator, sample

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------ params
def test_params_keep_the_schema_as_canonical_json_and_accept_a_dict():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    assert a.key == b.key and json.loads(a.json)["type"] == "object"
    params = SamplingParams(structured_outputs={"json_object": True})
    assert params.structured_outputs == StructuredOutputsParams(json_object=True)


@pytest.mark.parametrize("kwargs, words", [
    (dict(structured_outputs={}), "exactly one of json"),
    (dict(structured_outputs={"json": {"type": "object"}, "json_object": True}), "exactly one of json"),
    (dict(structured_outputs={"structural_tag": "{}"}), "unsupported field(s) ['structural_tag']"),
    (dict(structured_outputs={"regex": "a+", "choice": ["a"]}), "structured_outputs=regex=a+, choice=['a'] is "
                                                                  "invalid; allowed: exactly one of"),
    (dict(structured_outputs={"choice": []}), "structured_outputs.choice=[] is invalid; allowed: a non-empty list"),
    (dict(structured_outputs={"choice": ["a", ""]}), "structured_outputs.choice=['a', ''] is invalid"),
    (dict(structured_outputs={"choice": "yes"}), "structured_outputs.choice='yes' is invalid; allowed: a non-empty"),
    (dict(structured_outputs={"regex": " "}), "structured_outputs.regex=' ' is invalid; allowed: a non-empty"),
    (dict(structured_outputs={"grammar": 3}), "structured_outputs.grammar=3 is invalid"),
    (dict(structured_outputs={"json": "{not json"}), "structured_outputs.json='{not json' is not valid JSON"),
    (dict(structured_outputs={"json": [1]}), "structured_outputs.json=[1] is invalid"),
    (dict(structured_outputs="json"), "structured_outputs='json' (str) is invalid"),
    (dict(structured_outputs={"json_object": True}, min_tokens=3), "min_tokens=3 is invalid; allowed: 0 with"),
    (dict(structured_outputs={"json_object": True}, ignore_eos=True), "ignore_eos=True is invalid"),
])
def test_bad_structured_outputs_are_refused_naming_the_field(kwargs, words):
    with pytest.raises(ConfigError) as caught:
        SamplingParams(**kwargs)
    assert words in str(caught.value)


# ------------------------------------------------------------------------------ the sampler's mask
def bitmask(rows_allowed: list[list[int]], vocab: int) -> torch.Tensor:
    mask = torch.zeros((len(rows_allowed), bitmask_words(vocab)), dtype=torch.int32)
    for row, allowed in enumerate(rows_allowed):
        for token in allowed:
            word = int(mask[row, token // 32]) | (1 << (token % 32))
            mask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word  # as int32
    return mask


def test_constrained_rows_take_only_allowed_tokens_and_free_rows_are_untouched():
    vocab, rows = 100, 4
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(rows)]
    allowed = {1: [3, 31, 63, 99], 3: [0, 32]}  # bit 31 and the last partial word included
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    logits[1, [3, 31, 63, 99]] = -30.0  # allowed but unlikely: the mask must still force them
    for _ in range(20):
        gens = [request_generator(p, CPU) for p in params]
        masked = sample(logits, SamplingBatch.build(params, [[]] * rows, [[]] * rows, gens, CPU,
                                                    token_bitmask=([1, 3], bitmask(list(allowed.values()), vocab))))
        gens = [request_generator(p, CPU) for p in params]
        free = sample(logits, SamplingBatch.build(params, [[]] * rows, [[]] * rows, gens, CPU))
        for row, tokens in allowed.items():
            assert int(masked.token_ids[row]) in tokens
        assert masked.token_ids[0] == free.token_ids[0] and masked.token_ids[2] == free.token_ids[2]
        params = [SamplingParams(temperature=1.0, seed=p.seed + rows) for p in params]


def test_greedy_constrained_row_takes_the_best_allowed_token_and_logprobs_stay_raw():
    logits = torch.tensor([[5.0, 1.0, 3.0, 2.0] + [0.0] * 60])
    batch = SamplingBatch.build([SamplingParams(temperature=0, logprobs=0)], [[]], [[]], [None], CPU,
                                token_bitmask=([0], bitmask([[1, 3]], 64)))
    out = sample(logits, batch)
    assert int(out.token_ids[0]) == 3
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1)[:, 3])


# ------------------------------------------------------------------------------ the engine
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "size": {"type": "string", "enum": ["small", "large"]},
    "rooms": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 3}},
    "required": ["city", "size", "rooms"], "additionalProperties": False}


@pytest.mark.network
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_mixes_constrained_and_free_rows(default_model, async_scheduling):
    model, tokenizer = default_model
    llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="32MiB", max_num_seqs=8, max_model_len=512,
                       async_scheduling=async_scheduling)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Describe a house as JSON."}],
                                           add_generation_prompt=True, tokenize=False)
    spec = StructuredOutputsParams(json=SCHEMA)
    constrained = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, structured_outputs=spec) for i in range(3)]
    free = [SamplingParams(max_tokens=8, temperature=1.0, seed=i) for i in range(2)]
    outs = llm.generate([prompt] * 5, constrained + free)
    for out in outs[:3]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert llm.engine.grammars.num_compiles == 1  # one schema, one compile
    reference = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="32MiB", max_num_seqs=8,
                             max_model_len=512).generate([prompt] * 2, free)
    assert [o.token_ids for o in outs[3:]] == [o.token_ids for o in reference]  # free rows: as if alone
    assert llm.stats().used_blocks == 0


@pytest.mark.network
def test_a_schema_that_cannot_compile_is_a_config_error(default_model):
    model, tokenizer = default_model
    llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="16MiB", max_num_seqs=2, max_model_len=256)
    with pytest.raises(ConfigError, match="cannot be compiled"):
        llm.generate(["hi"], SamplingParams(structured_outputs={"json": {"type": "nonsense"}}))


@pytest.mark.network
def test_regex_choice_and_grammar_bind_every_seeded_sample(default_model):
    """vLLM's other constraints: each of 4 samples at temperature 1 matches, whole."""
    import re

    model, tokenizer = default_model
    llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="32MiB", max_num_seqs=8, max_model_len=512)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name a capital and a code."}],
                                           add_generation_prompt=True, tokenize=False)
    specs = {"regex": (r"[A-Z][a-z]{2,8}-[0-9]{3}", lambda t: re.fullmatch(r"[A-Z][a-z]{2,8}-[0-9]{3}", t)),
             "choice": (["Paris", "Rome", "New Delhi"], lambda t: t in ("Paris", "Rome", "New Delhi")),
             "grammar": ('root ::= city ", " city\ncity ::= "Paris" | "Rome"',
                         lambda t: re.fullmatch("(Paris|Rome), (Paris|Rome)", t))}
    for kind, (value, matches) in specs.items():
        params = [SamplingParams(max_tokens=30, temperature=1.0, seed=i, structured_outputs={kind: value})
                  for i in range(4)]
        for out in llm.generate([prompt] * 4, params):
            assert out.finish_reason == "stop" and matches(out.text), (kind, out.text)
    assert StructuredOutputsParams(choice=["a"]).key != StructuredOutputsParams(regex="a").key
    with pytest.raises(ConfigError, match=r"structured_outputs=regex=\[a- cannot be compiled: .*allowed: a regular "
                                          "expression xgrammar supports"):
        llm.generate(["hi"], SamplingParams(structured_outputs={"regex": "[a-"}))
    with pytest.raises(ConfigError, match="allowed: an EBNF grammar with a root rule"):
        llm.generate(["hi"], SamplingParams(structured_outputs={"grammar": 'start ::= "a"'}))
    assert llm.stats().used_blocks == 0


@pytest.mark.network
def test_each_parallel_sample_has_its_own_grammar_matcher(default_model):
    """n > 1 with structured outputs: every forked sample follows the schema from the same start."""
    model, tokenizer = default_model
    llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="32MiB", max_num_seqs=8, max_model_len=512)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Describe a house as JSON."}],
                                           add_generation_prompt=True, tokenize=False)
    out = llm.generate(prompt, SamplingParams(n=3, max_tokens=60, temperature=1.0, seed=4,
                                              structured_outputs=StructuredOutputsParams(json=SCHEMA)))[0]
    assert len({o.text for o in out.outputs}) > 1  # the samples differ
    for sample in out.outputs:
        assert sample.finish_reason == "stop", sample.text
        jsonschema.validate(json.loads(sample.text), SCHEMA)
    assert llm.stats().used_blocks == 0
