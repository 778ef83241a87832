"""prefill_attention: which varlen kernel attends prompt chunks, the errors for what cannot run, and how
FlashAttention-4 writes into a given output (against a stand-in module: the real one needs a GPU)."""

import pytest
import torch

import ponytail
from ponytail.attention.fa4 import choose_prefill_attention, fa4_problem
from transformers import LlamaConfig, LlamaForCausalLM

CPU = torch.device("cpu")


def test_unset_and_flash_take_torch_flash_on_the_cpu():
    assert choose_prefill_attention(None, CPU, torch.bfloat16, 128) == "flash"
    assert choose_prefill_attention("flash", CPU, torch.bfloat16, 128) == "flash"


def test_an_unknown_kernel_names_the_parameter_and_the_choices():
    with pytest.raises(ponytail.ConfigError) as caught:
        choose_prefill_attention("fa3", CPU, torch.bfloat16, 128)
    assert str(caught.value).startswith("prefill_attention='fa3' is not supported; allowed: 'flash', 'fa4' or None")


def test_fa4_where_it_cannot_run_says_why():
    with pytest.raises(ponytail.ConfigError) as caught:
        choose_prefill_attention("fa4", CPU, torch.bfloat16, 128)
    assert "prefill_attention='fa4' cannot run here: device is cpu, not CUDA" in str(caught.value)
    assert "pip install 'ponytail[fa4]'" in str(caught.value)


def test_fa4_problems_name_dtype_and_head_dim(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fa4_problem(cuda, torch.float32, 128) == "FlashAttention-4 takes fp16/bf16, got torch.float32"
    assert "head_dim a multiple of 8 from 8 to 256, got 100" in fa4_problem(cuda, torch.bfloat16, 100)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert fa4_problem(cuda, torch.bfloat16, 128).endswith("this device is sm8x")


def test_llm_refuses_fa4_on_the_cpu_before_building_its_pool():
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100)).eval()
    with pytest.raises(ponytail.ConfigError, match="prefill_attention='fa4' cannot run here"):
        ponytail.LLM(model, kv_cache_memory="4MiB", max_num_seqs=2, max_model_len=64, prefill_attention="fa4")


def test_app_args_take_only_the_kernels_there_are():
    from deployments.app.args import AppArgs

    assert AppArgs(engine={"prefill_attention": "fa4"}).engine == {"prefill_attention": "fa4"}
    with pytest.raises(ValueError, match="prefill_attention='fa3' is not supported; allowed: 'flash', 'fa4'"):
        AppArgs(engine={"prefill_attention": "fa3"})



@pytest.fixture
def fake_fa4(monkeypatch):
    """install(forward): a stand-in flash_attn.cute.interface whose public varlen function returns
    q * scale and whose private forward is `forward` (None: absent); returns (fa4 module, the calls
    made, in order). fa4's cached lookup of that forward is cleared before and after."""
    import functools
    import sys
    import types

    from ponytail.attention import fa4

    def install(forward):
        calls = []

        def varlen_func(q, k, v, **kwargs):
            calls.append("public")
            return q * kwargs["softmax_scale"], None

        interface = types.ModuleType("flash_attn.cute.interface")
        interface.flash_attn_varlen_func = varlen_func
        if forward is not None:
            @functools.wraps(forward)  # its signature is what fa4 inspects
            def recorded(*args, **kwargs):
                calls.append("forward")
                return forward(*args, **kwargs)

            interface._flash_attn_fwd = recorded
        cute = types.ModuleType("flash_attn.cute")
        cute.interface = interface
        package = types.ModuleType("flash_attn")
        package.cute = cute
        for name, module in (("flash_attn", package), ("flash_attn.cute", cute),
                             ("flash_attn.cute.interface", interface)):
            monkeypatch.setitem(sys.modules, name, module)
        fa4._forward_into.cache_clear()
        return fa4, calls

    yield install
    fa4._forward_into.cache_clear()


def test_fa4_writes_into_out_through_its_forward_where_that_takes_out(fake_fa4):
    def forward(q, k, v, *, softmax_scale, out=None, **kwargs):
        out.copy_(q * softmax_scale)
        return out, None, None, None, None

    fa4, calls = fake_fa4(forward)
    q = torch.randn(5, 2, 8)
    step = torch.full((7, 2, 8), float("nan"))
    got = fa4.fa4_varlen(q, q, q, None, None, 5, 5, 0.5, out=step[2:])
    assert got.data_ptr() == step[2:].data_ptr() and torch.equal(step[2:], q * 0.5) and step[:2].isnan().all()
    assert fa4.fa4_varlen(q, q, q, None, None, 5, 5, 0.5).equal(q * 0.5)  # no out: the public function
    assert calls == ["forward", "public"]


@pytest.mark.parametrize("forward", [None, lambda q, k, v, **kwargs: None], ids=["absent", "without out"])
def test_fa4_without_such_a_forward_copies_the_public_result_into_out(fake_fa4, forward):
    fa4, calls = fake_fa4(forward)
    q = torch.randn(5, 2, 8)
    step = torch.zeros(6, 2, 8)
    got = fa4.fa4_varlen(q, q, q, None, None, 5, 5, 2.0, out=step[1:])
    assert got.data_ptr() == step[1:].data_ptr() and torch.equal(step[1:], q * 2) and not step[0].any()
    assert calls == ["public"]


def test_fa4_paged_reads_through_the_page_table_into_out(fake_fa4):
    seen = {}

    def forward(q, k, v, *, softmax_scale, out=None, page_table=None, seqused_k=None, cu_seqlens_q=None,
                max_seqlen_q=None, max_seqlen_k=None, causal=False):
        seen.update(page_table=page_table, seqused_k=seqused_k, max_seqlen_k=max_seqlen_k, causal=causal,
                    pages=k.shape[0])
        out.copy_(q * softmax_scale)

    fa4, calls = fake_fa4(forward)
    assert fa4.fa4_pages_problem() is None
    q = torch.randn(5, 2, 8)
    pages = torch.randn(10, 4, 1, 8)  # 10 pages of 4 keys
    table = torch.tensor([[3, 7, 0]], dtype=torch.int32)
    step = torch.full((6, 2, 8), float("nan"))
    got = fa4.fa4_paged(q, pages, pages, table, torch.tensor([0, 5]), torch.tensor([9]), 5, 0.5, out=step[1:])
    assert got.data_ptr() == step[1:].data_ptr() and torch.equal(got, q * 0.5) and step[0].isnan().all()
    assert seen["page_table"] is table and seen["seqused_k"].tolist() == [9] and seen["causal"]
    assert seen["max_seqlen_k"] == 12 and seen["pages"] == 10 and calls == ["forward"]


@pytest.mark.parametrize("forward, missing", [
    (None, "no forward that writes into a given tensor"),
    (lambda q, k, v, *, out=None, seqused_k=None: None, "has no page_table"),
    (lambda q, k, v, *, out=None: None, "has no page_table, seqused_k"),
], ids=["no forward", "no page table", "neither"])
def test_fa4_pages_problem_says_what_the_installed_version_lacks(fake_fa4, forward, missing):
    fa4, _ = fake_fa4(forward)
    assert missing in fa4.fa4_pages_problem()


def test_fa4_paged_without_such_a_forward_is_a_config_error_saying_why(fake_fa4):
    fa4, calls = fake_fa4(None)
    q = torch.randn(5, 2, 8)
    with pytest.raises(ponytail.ConfigError) as caught:
        fa4.fa4_paged(q, q, q, torch.zeros((1, 1), dtype=torch.int32), None, None, 5, 0.5, out=q)
    assert str(caught.value) == ("FlashAttention-4 cannot read K/V through a page table here: the installed "
                                 "flash-attn-4 has no forward that writes into a given tensor")
    assert calls == []
