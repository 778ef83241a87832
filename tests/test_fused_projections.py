"""fuse_projections: one GEMM for q/k/v and gate/up, same outputs, no extra memory, undone cleanly."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ponytail
from ponytail import SamplingParams
from ponytail.errors import ConfigError
from ponytail.runner.compile import restore_decoder_layers
from ponytail.runner.fused_projections import can_fuse, fuse_projections, unfuse_projections
from test_engine import plain_greedy
from tiny_models import sharp_llama

MEMBERS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, **overrides)
    return LlamaForCausalLM(config).eval()


def members(model):
    for layer in model.model.layers:
        for owner in (layer.self_attn, layer.mlp):
            for name in MEMBERS:
                if hasattr(owner, name):
                    yield getattr(owner, name)


def storage_bytes(model) -> int:
    seen = {}
    for p in model.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("bias", [False, True])
def test_fused_model_gives_the_same_logits_in_the_same_memory(bias):
    model = llama(attention_bias=bias, mlp_bias=bias)
    ids = torch.randint(0, 300, (3, 17))
    with torch.no_grad():
        expected = model(ids).logits
    weights = {id(m): m.weight.clone() for m in members(model)}
    before = storage_bytes(model)
    assert can_fuse(model)
    assert fuse_projections(model) == 4  # q/k/v and gate/up in each of 2 layers
    assert fuse_projections(model) == 4  # fusing again is a no-op (a model handed to a second LLM)
    assert storage_bytes(model) == before  # members are views of the fused weights, the old ones are gone
    attn = model.model.layers[0].self_attn
    fused = attn.q_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused == attn.v_proj.weight.untyped_storage().data_ptr()
    assert all(torch.equal(m.weight, weights[id(m)]) for m in members(model))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    unfuse_projections(model)
    assert not any("forward" in vars(m) for m in members(model))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_members_called_out_of_order_or_on_other_inputs_run_their_own_gemm():
    model = llama()
    attn = model.model.layers[0].self_attn
    x, y = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    with torch.no_grad():
        separate = {name: getattr(attn, name)(x) for name in ("q_proj", "k_proj", "v_proj")}
        other = attn.k_proj(y)
        fuse_projections(model)
        assert torch.allclose(attn.v_proj(x), separate["v_proj"], atol=1e-6)  # before any q_proj: its own
        assert torch.allclose(attn.q_proj(x), separate["q_proj"], atol=1e-6)  # the fused GEMM
        assert torch.allclose(attn.k_proj(y), other, atol=1e-6)  # another input than q_proj's: its own
        assert torch.allclose(attn.k_proj(x), separate["k_proj"], atol=1e-6)  # q_proj's input: its slice
        assert torch.allclose(attn.v_proj(x), separate["v_proj"], atol=1e-6)


def test_engine_with_fused_projections_keeps_greedy_output(default_model):
    tokenizer = default_model[1]
    model = sharp_llama(tokenizer, layers=4)
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    expected = [plain_greedy(model, p, 6) for p in prompts]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="4MiB", max_num_seqs=4, max_model_len=128,
                       tuning={"fuse_projections": True})
    try:
        assert all("forward" in vars(m) for m in members(model))
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        unfuse_projections(model)


def test_compiled_layers_trace_the_fused_gemm(default_model):
    tokenizer = default_model[1]
    model = sharp_llama(tokenizer, layers=2)
    rng = random.Random(4)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randint(4, 40))] for _ in range(3)]
    expected = [plain_greedy(model, p, 5) for p in prompts]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="4MiB", max_num_seqs=4, max_model_len=128,
                           compile_model=True, tuning={"fuse_projections": True})
        outputs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        assert [o.token_ids for o in outputs] == expected
        # The fused call keeps Python state between members; dynamo must trace it, not break on it.
        breaks = {str(reason) for reason in torch._dynamo.utils.counters["graph_break"]}
        assert not [b for b in breaks if "fused" in b or "_Pending" in b], breaks
    finally:
        restore_decoder_layers(model)
        unfuse_projections(model)
        torch._dynamo.reset()


def test_fuse_projections_refuses_what_it_cannot_fuse(default_model):
    model = llama()
    for layer in model.model.layers:  # a model whose projections are already one module each
        for name in MEMBERS:
            if hasattr(layer.self_attn, name):
                setattr(layer.self_attn, name, torch.nn.Identity())
            if hasattr(layer.mlp, name):
                setattr(layer.mlp, name, torch.nn.Identity())
    assert not can_fuse(model)
    with pytest.raises(ConfigError, match="fuse_projections=True found nothing to fuse in LlamaForCausalLM"):
        fuse_projections(model)
    with pytest.raises(ConfigError, match=r"fuse_projections='yes' is not supported; allowed: True, False or None"):
        ponytail.LLM(llama(), tokenizer=default_model[1], kv_cache_memory="4MiB",
                     tuning={"fuse_projections": "yes"})
    no_layers = torch.nn.Linear(4, 4)
    assert not can_fuse(no_layers)
    with pytest.raises(ConfigError, match="fuse_projections=True needs a decoder with a `layers` list; Linear"):
        fuse_projections(no_layers)


def test_default_leaves_cpu_models_and_handed_over_models_unfused(default_model, tmp_path):
    """None fuses only on CUDA and only a model LLM loaded itself (the GPU tests cover that side)."""
    model = llama()
    ponytail.LLM(model, tokenizer=default_model[1], kv_cache_memory="4MiB", max_model_len=64)
    assert not any("forward" in vars(m) for m in members(model))
    model.save_pretrained(tmp_path)
    default_model[1].save_pretrained(tmp_path)
    loaded = ponytail.LLM(str(tmp_path), kv_cache_memory="4MiB", max_model_len=64).engine.model
    assert not any("forward" in vars(m) for m in members(loaded))
