"""The plug-in on a GPU: generate with a Ponytail cache (CuPy decode kernel) against plain generate."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ponytail

pytestmark = pytest.mark.gpu


def model_and_prompts(dtype):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).to("cuda", dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # sharper logits: no greedy near-ties on random weights
    gen = torch.Generator().manual_seed(1)
    lengths = [37, 5, 120, 64]
    ids = torch.zeros(4, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(1, 512, (n,), generator=gen)
        mask[row, -n:] = 1
    return model, ids.cuda(), mask.cuda()


def run(model, ids, mask, cache=None):
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
                  output_logits=True, return_dict_in_generate=True)
    if cache is not None:
        kwargs["cache"] = cache
    return model.generate(ids, **kwargs)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)])
def test_generate_with_ponytail_cache_matches_plain_generate(dtype, tol, monkeypatch):
    monkeypatch.setenv("PONYTAIL_KERNELS", "cupy")  # the custom kernels, or an error: never a silent fallback
    model, ids, mask = model_and_prompts(dtype)
    plain = run(model, ids, mask)
    cache = ponytail.create_cache(model=model, max_batch_size=4, max_seq_len=256)
    ours = run(model, ids, mask, cache)
    steps = len(plain.logits) if dtype == torch.float32 else 4  # bf16: compare before paths can diverge
    for step in range(steps):
        a, b = ours.logits[step].float(), plain.logits[step].float()
        rel = ((a - b).norm() / b.norm()).item()
        print(f"{dtype} step {step}: relative logit error {rel:.2e}")
        assert rel < tol
    if dtype == torch.float32:
        assert torch.equal(ours.sequences, plain.sequences)
    assert cache.paged.invariants() == []


def test_beam_search_on_the_gpu_matches_plain_generate(monkeypatch):
    """Beams share blocks and copy a shared last block on write (copy_blocks on the device): fp32
    sequences equal plain generate's, and the prompt is held once per batch row."""
    monkeypatch.setenv("PONYTAIL_KERNELS", "cupy")
    model, ids, mask = model_and_prompts(torch.float32)
    ids, mask = ids[:2], mask[:2]
    settings = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, num_beams=4,
                    num_return_sequences=2, return_dict_in_generate=True, output_scores=True)
    plain = model.generate(ids, **settings)
    cache = ponytail.create_cache(model=model, max_batch_size=8, max_seq_len=256)
    ours = model.generate(ids, cache=cache, **settings)
    assert torch.equal(ours.sequences, plain.sequences)
    torch.testing.assert_close(ours.sequences_scores, plain.sequences_scores, rtol=1e-3, atol=1e-3)
    apart = sum(-(-cache.paged.seq_len(row) // cache.config.block_size) for row in range(8))
    assert cache.stats().used_blocks < apart  # beams of one prompt share its blocks
    assert cache.paged.invariants() == []


def test_assisted_decoding_on_the_gpu_matches_plain_generate(monkeypatch):
    """Prompt lookup: multi-token verification steps over context, then crop() and slot reuse."""
    monkeypatch.setenv("PONYTAIL_KERNELS", "cupy")
    model, ids, _ = model_and_prompts(torch.float32)
    prompt = torch.cat([ids[3, -64:], ids[3, -64:-40]])[None]  # repeats: lookups find candidates
    plain = model.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=0)
    cache = ponytail.create_cache(model=model, max_batch_size=1, max_seq_len=256)
    ours = model.generate(prompt, cache=cache, max_new_tokens=32, do_sample=False, pad_token_id=0,
                          prompt_lookup_num_tokens=4)
    assert torch.equal(ours, plain)
    assert cache.paged.invariants() == []
