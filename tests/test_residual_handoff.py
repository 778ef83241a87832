"""Compiled layers hand their closing residual add to the next layer's norm (runner/residual_handoff.py):
the same sums as the stock layers, only for LlamaDecoderLayer's forward, never past a hook, errors that
say what broke."""

import random
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM

import ponytail
from ponytail import SamplingParams
from ponytail.runner import residual_handoff
from ponytail.runner.compile import restore_decoder_layers
from ponytail.runner.residual_handoff import (HANDOFF_ATTR, ResidualHandoff, check_consumed, handoff_forward,
                                              layers_can_hand_off)

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=300, max_position_embeddings=256)


def build(model_class, config_class, **overrides):
    torch.manual_seed(0)
    return model_class(config_class(**SHAPE, **overrides)).eval()


@torch.no_grad()
def test_handing_off_sums_to_the_stock_layers_bit_for_bit():
    model = build(LlamaForCausalLM, LlamaConfig)
    decoder = model.model
    x = torch.randn(1, 9, SHAPE["hidden_size"])
    positions = torch.arange(9)[None]
    kwargs = dict(position_ids=positions, position_embeddings=decoder.rotary_emb(x, positions), attention_mask=None)
    stock = x
    for layer in decoder.layers:
        stock = layer(stock, **kwargs)
    out, residual = x, torch.zeros_like(x)
    for layer in decoder.layers:
        out, residual = handoff_forward(layer, out, residual, **kwargs)
    assert torch.equal(out + residual, stock)


def test_only_llamas_layer_forward_hands_off():
    for model_class, config_class in ((LlamaForCausalLM, LlamaConfig), (Qwen2ForCausalLM, Qwen2Config)):
        model = build(model_class, config_class)
        assert layers_can_hand_off(model.model.layers, model.model), model_class.__name__
    phi3 = build(Phi3ForCausalLM, Phi3Config, pad_token_id=0)  # its layer adds dropout around the residuals
    assert not layers_can_hand_off(phi3.model.layers, phi3.model)
    llama = build(LlamaForCausalLM, LlamaConfig)
    del llama.model.norm  # nothing to take the last layer's add
    assert not layers_can_hand_off(llama.model.layers, llama.model)


def test_a_replaced_output_and_an_unconsumed_add_are_errors_that_say_so():
    handoff = ResidualHandoff(modules=[])
    x = torch.ones(2, 4)
    zeros = handoff.start(x, by_name_only=True)
    assert handoff.active and torch.equal(zeros, torch.zeros_like(x))
    out = handoff.give(x * 2, x)
    assert handoff.pending
    with pytest.raises(RuntimeError, match=r"decoder layer 1 expected the previous decoder layer's output with its "
                                           r"residual add still pending .* but it received another tensor: something "
                                           r"between the decoder's layers replaced their output; build the LLM "
                                           r"with compile_model=False"):
        handoff.take(out.clone(), "decoder layer 1")
    assert torch.equal(handoff.take(out, "decoder layer 1"), x) and not handoff.pending
    with pytest.raises(RuntimeError, match="but no layer handed off a residual"):
        handoff.take(out, residual_handoff.FINAL_NORM)
    # A hook anywhere on the decoder: the pass runs the stock forwards.
    layer = torch.nn.Linear(2, 2)
    hooked = ResidualHandoff(modules=[layer])
    handle = layer.register_forward_hook(lambda *args: None)
    hooked.start(x, by_name_only=True)
    assert not hooked.active
    handle.remove()
    hooked.start(x, by_name_only=False)  # a caller that passes more than the hidden states positionally
    assert not hooked.active

    class Owner:
        pass

    model = Owner()
    setattr(model, HANDOFF_ATTR, handoff)
    handoff.give(out, x)
    with pytest.raises(RuntimeError, match=r"the decoder's last layer left its residual add to the final norm, which "
                                           r"never ran on its output: Owner's decoder does not end with its `norm`"):
        check_consumed(model)
    assert not handoff.pending  # the next pass starts clean
    check_consumed(model)


def test_install_wraps_the_final_norm_and_uninstall_restores_it():
    model = build(LlamaForCausalLM, LlamaConfig)
    decoder = model.model
    handoff = residual_handoff.install(model, decoder, decoder.layers)
    assert vars(model)[HANDOFF_ATTR] is handoff and "forward" in vars(decoder.norm)
    x = torch.randn(3, SHAPE["hidden_size"])
    assert torch.equal(decoder.norm(x), type(decoder.norm).forward(decoder.norm, x))  # nothing pending: as before
    residual_handoff.uninstall(model, decoder)
    assert HANDOFF_ATTR not in vars(model) and "forward" not in vars(decoder.norm)
    phi3 = build(Phi3ForCausalLM, Phi3Config, pad_token_id=0)
    assert residual_handoff.install(phi3, phi3.model, phi3.model.layers) is None
    assert "forward" not in vars(phi3.model.norm)


@pytest.mark.network  # the default model's tokenizer
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler (g++ or c++ on PATH)")
def test_the_engine_hands_off_and_a_hooked_pass_runs_the_stock_layers(default_model, monkeypatch):
    from test_engine import plain_greedy
    from tiny_models import sharp_llama

    tokenizer = default_model[1]
    model = sharp_llama(tokenizer, layers=4)
    rng = random.Random(6)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randint(4, 40))] for _ in range(3)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    expected = [plain_greedy(model, p, 5) for p in prompts]
    given = []
    give = ResidualHandoff.give
    monkeypatch.setattr(ResidualHandoff, "give",
                        lambda self, out, residual: given.append(1) or give(self, out, residual))
    torch._dynamo.reset()
    try:
        llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="4MiB", max_num_seqs=4, max_model_len=128,
                           compile_model=True)
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        assert given and len(given) % len(model.model.layers) == 0  # every layer of every step handed off
        assert not vars(model)[HANDOFF_ATTR].pending
        seen = []
        handle = model.model.layers[1].register_forward_hook(lambda module, args, output: seen.append(output))
        given.clear()
        try:
            assert [o.token_ids for o in llm.generate(prompts[:1], params)] == expected[:1]
        finally:
            handle.remove()
        assert seen and not given  # the hook saw whole outputs: no layer handed off
        assert llm.stats().used_blocks == 0
    finally:
        restore_decoder_layers(model)
        torch._dynamo.reset()
    assert HANDOFF_ATTR not in vars(model) and "forward" not in vars(model.model.norm)
