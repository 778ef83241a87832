"""column_major_weights: the projections' weights stored column-major, same outputs, same memory,
kept by fusing and compiling; cuBLASLt scoped to the model's calls (its GPU side: test_gpu_engine)."""

import random

import pytest
import torch

import ponytail
from ponytail import SamplingParams
from ponytail.errors import ConfigError
from ponytail.runner.compile import restore_decoder_layers
from ponytail.runner.fused_projections import fuse_projections, unfuse_projections
from ponytail.runner.gemm_layout import (blas_library, column_major_weights, forward_through_cublaslt, is_column_major,
                                         row_major_weights)
from test_engine import plain_greedy
from test_fused_projections import llama, storage_bytes
from tiny_models import sharp_llama


def layer_linears(model):
    return [m for layer in model.model.layers for m in layer.modules() if type(m) is torch.nn.Linear]


@pytest.mark.parametrize("tied", [False, True])
def test_column_major_weights_give_the_same_logits_in_the_same_memory(tied):
    model = llama(tie_word_embeddings=tied)
    ids = torch.randint(0, 300, (3, 17))
    with torch.no_grad():
        expected = model(ids).logits
    weights = {id(m): m.weight.clone() for m in layer_linears(model) + [model.lm_head]}
    before = storage_bytes(model)
    # 7 projections in each of 2 layers, and the head unless it is the embedding's weight
    assert column_major_weights(model) == 14 + (not tied)
    assert column_major_weights(model) == 0  # done already: nothing copied again
    assert storage_bytes(model) == before
    assert all(is_column_major(m.weight) for m in layer_linears(model))
    assert is_column_major(model.lm_head.weight) is not tied
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tied
    assert model.model.embed_tokens.weight.is_contiguous()  # lookups keep their rows
    assert all(torch.equal(m.weight, weights[id(m)]) for m in layer_linears(model) + [model.lm_head])
    assert all(m.weight.shape == weights[id(m)].shape for m in layer_linears(model))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_fusing_after_the_layout_keeps_it_and_the_memory():
    model = llama()
    ids = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        expected = model(ids).logits
    column_major_weights(model)
    before = storage_bytes(model)
    assert fuse_projections(model) == 4
    try:
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert storage_bytes(model) == before
        assert all(is_column_major(m.weight) for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj))
        assert attn.v_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
        assert column_major_weights(model) == 0  # fused members are left to their group
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    finally:
        unfuse_projections(model)


def test_engine_with_column_major_weights_keeps_greedy_output(default_model):
    tokenizer = default_model[1]
    model = sharp_llama(tokenizer, layers=3)
    rng = random.Random(6)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    expected = [plain_greedy(model, p, 6) for p in prompts]
    torch._dynamo.reset()
    try:
        llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="4MiB", max_num_seqs=4, max_model_len=128,
                           compile_model=True,
                           tuning={"column_major_weights": True, "fuse_projections": True})
        assert all(is_column_major(m.weight) for m in layer_linears(model))
        outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert [o.token_ids for o in outputs] == expected
    finally:
        restore_decoder_layers(model)
        unfuse_projections(model)
        torch._dynamo.reset()


def test_default_leaves_cpu_and_handed_over_models_as_they_are(default_model):
    model = llama()
    ponytail.LLM(model, tokenizer=default_model[1], kv_cache_memory="4MiB", max_model_len=64)
    assert not any(is_column_major(m.weight) for m in layer_linears(model))
    assert "forward" not in vars(model)  # cuBLASLt only for CUDA devices
    with pytest.raises(ConfigError, match=r"column_major_weights='yes' is not supported; allowed: True, False or None"):
        ponytail.LLM(llama(), tokenizer=default_model[1], kv_cache_memory="4MiB",
                     tuning={"column_major_weights": "yes"})
    with pytest.raises(ConfigError, match="column_major_weights=True needs a decoder with a `layers` list; Linear"):
        column_major_weights(torch.nn.Linear(4, 4))


def test_cublaslt_wrapper_passes_calls_through_once():
    model = llama()
    ids = torch.randint(0, 300, (1, 5))
    with torch.no_grad():
        expected = model(ids).logits
    forward_through_cublaslt(model)
    wrapped = model.forward
    forward_through_cublaslt(model)  # a second LLM on the same model does not wrap it twice
    assert model.forward is wrapped
    with torch.no_grad(), blas_library(None):
        torch.testing.assert_close(model(ids).logits, expected)


def test_row_major_weights_undoes_layout_fusing_and_wrapper():
    """What a benchmark does between engines on one model object: the next one gets it as loaded."""
    model = llama()
    ids = torch.randint(0, 300, (2, 7))
    with torch.no_grad():
        expected = model(ids).logits
    before = storage_bytes(model)
    column_major_weights(model)
    fuse_projections(model)
    forward_through_cublaslt(model)
    unfuse_projections(model)
    assert row_major_weights(model) == 15  # 14 projections (fused members included) and the untied head
    assert "forward" not in vars(model)
    assert all(m.weight.is_contiguous() for m in layer_linears(model) + [model.lm_head])
    assert storage_bytes(model) == before  # the fused weights are gone with their last view
    assert row_major_weights(model) == 0
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
