"""The CPU output projection through oneDNN (runner/cpu_head.py): float32 logits within rounding of
torch's linear, packed again when the weight changes, active only inside the engine's steps."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import ponytail
from ponytail import SamplingParams
from ponytail.runner import cpu_head
from ponytail.runner.cpu_head import PrepackedHead, prepacked_head

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def reference(x, linear):
    return (x.double() @ linear.weight.double().T + (0 if linear.bias is None else linear.bias.double())).float()


def close_to_reference(y, x, linear):
    # float32 products summed in some order: |error| <= k * eps * sum |x_i w_i|, k the inner size.
    bound = x.shape[-1] * torch.finfo(torch.float32).eps * (x.double().abs() @ linear.weight.double().abs().T)
    return bool(((y.double() - reference(x, linear).double()).abs() <= bound.float() + 1e-6).all())


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, cpu_head.MAX_ROWS + 8), inner=st.integers(1, 96), vocab=st.integers(1, 300),
       bias=st.booleans(), leading=st.booleans())
def test_logits_are_float32_rounding_of_the_exact_product(rows, inner, vocab, bias, leading):
    torch.manual_seed(rows * 1000 + inner)
    linear = torch.nn.Linear(inner, vocab, bias=bias)
    x = torch.randn(1, rows, inner) if leading else torch.randn(rows, inner)
    with torch.inference_mode():
        y = PrepackedHead(linear).forward(x)
    assert y.shape == (*x.shape[:-1], vocab) and y.dtype == torch.float32
    assert close_to_reference(y, x, linear)


def test_a_weight_changed_in_place_or_replaced_is_packed_again():
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 50, bias=False)
    head = PrepackedHead(linear)
    x = torch.randn(4, 32)
    with torch.no_grad():
        linear.weight.mul_(-3)  # in place: the version counter moves
    with torch.inference_mode():
        assert close_to_reference(head.forward(x), x, linear)
    linear.weight = torch.nn.Parameter(torch.randn(50, 32))  # another tensor
    with torch.inference_mode():
        assert close_to_reference(head.forward(x), x, linear)


def test_many_rows_and_autograd_use_torchs_linear_exactly():
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 20)
    head = PrepackedHead(linear)
    many = torch.randn(cpu_head.MAX_ROWS + 1, 16)
    with torch.inference_mode():
        assert torch.equal(head.forward(many), torch.nn.functional.linear(many, linear.weight, linear.bias))
    few = torch.randn(3, 16, requires_grad=True)
    head.forward(few).sum().backward()  # the oneDNN op has no backward; torch's linear does
    assert few.grad is not None


def test_active_switches_the_modules_forward_only_inside_the_block():
    linear = torch.nn.Linear(8, 8)
    head = PrepackedHead(linear)
    with head.active():
        assert linear.forward == head.forward
    assert "forward" not in vars(linear)
    with pytest.raises(RuntimeError, match="boom"), head.active():
        raise RuntimeError("boom")
    assert "forward" not in vars(linear)


def test_only_a_float32_linear_head_on_the_cpu_is_prepacked():
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)
    model = LlamaForCausalLM(config)
    assert isinstance(prepacked_head(model), PrepackedHead)
    assert prepacked_head(model.to(torch.bfloat16)) is None
    assert prepacked_head(torch.nn.Linear(4, 4)) is None  # no get_output_embeddings: not a causal LM


def test_the_engine_uses_it_and_leaves_the_models_head_as_it_was():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=200, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # no greedy near-ties on random weights
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [3]]
    expected = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    llm = ponytail.LLM(model, device="cpu", kv_cache_memory="16MiB", max_model_len=64)
    assert llm.engine.runner.head is not None and llm.engine.runner.head.linear is model.lm_head
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert "forward" not in vars(model.lm_head)
