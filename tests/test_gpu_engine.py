"""The engine on a GPU (CuPy kernels forced): greedy output equals plain generate in fp32, with and
without CUDA graphs; in bf16 (the flash varlen prefill) the first token of each prompt agrees with
plain transformers wherever the top two logits are not a near tie."""

import math
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ponytail
from ponytail import SamplingParams
from ponytail.runner.gemm_layout import is_column_major

pytestmark = pytest.mark.gpu


def small_model(dtype=torch.float32):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).to("cuda", dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_engine_greedy_equals_plain_generate_on_gpu(monkeypatch, cuda_graphs):
    monkeypatch.setenv("PONYTAIL_KERNELS", "cupy")
    model = small_model()
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(5, 300))] for _ in range(12)]
    expected = []
    for p in prompts:
        out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    llm = ponytail.LLM(model, kv_cache_memory="64MiB", max_num_seqs=8, max_model_len=512,
                       max_num_batched_tokens=512, cuda_graphs=cuda_graphs)
    chunks_before = llm.engine.cache.num_chunks
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    assert llm.stats().used_blocks == 0 and llm.engine.cache.invariants() == []
    graphs = llm.engine.runner.graphs
    assert (graphs is not None and graphs.replays > 0) == cuda_graphs
    # The pool grew while the graphs (captured against the first chunk) were replayed.
    assert llm.engine.cache.peak_allocated_bytes > chunks_before * llm.engine.cache.storage.chunk_bytes



def test_llm_measures_the_step_overhead_where_graphs_replay_and_writes_nothing():
    """LLM() times a step with a prompt chunk against the decode graph's replay (runner/step_overhead.py)
    for the scheduler's prefill delay: at 1 row and at the largest graph; it counts no replays and
    leaves the pool as it was (the greedy test above checks the outputs after it)."""
    llm = ponytail.LLM(small_model(), kv_cache_memory="64MiB", max_num_seqs=8, max_model_len=512, cuda_graphs=True)
    overhead = llm.engine.runner.step_overhead
    assert llm.engine.scheduler.step_overhead is overhead
    assert overhead.rows == (1, 8) and all(math.isfinite(s) and s >= 0 for s in overhead.seconds)
    assert llm.engine.runner.graphs.replays == 0
    assert llm.stats().used_blocks == 0 and llm.engine.cache.invariants() == []
    eager = ponytail.LLM(small_model(), kv_cache_memory="64MiB", max_num_seqs=8, max_model_len=512, cuda_graphs=False)
    assert eager.engine.runner.step_overhead is None and eager.engine.scheduler.step_overhead is None

@pytest.mark.parametrize("prefill_attention", ["flash", "fa4"])
def test_bf16_engine_first_tokens_match_plain_transformers(monkeypatch, prefill_attention):
    """Prefix hits and chunked prefill send chunks with context through the varlen path: torch's
    flash, or FlashAttention-4 where installed, which reads those chunks' blocks in place through
    the pool's page view (every call counted, so the test knows each ran)."""
    from ponytail.attention import fa4, flash, paged

    monkeypatch.setenv("PONYTAIL_KERNELS", "cupy")
    if prefill_attention == "fa4" and (problem := fa4.fa4_problem(torch.device("cuda"), torch.bfloat16, 64)):
        pytest.skip(f"FlashAttention-4 cannot run here: {problem}")
    calls = []
    monkeypatch.setattr(flash, "fa4_varlen",
                        lambda *a, **kw: calls.append(a[3].shape[0] - 1) or fa4.fa4_varlen(*a, **kw))
    paged_calls = []
    monkeypatch.setattr(paged, "fa4_paged", lambda *a, **kw: paged_calls.append(a[3].shape) or fa4.fa4_paged(*a, **kw))
    model = small_model(torch.bfloat16)
    rng = random.Random(1)
    shared = [rng.randrange(1, 1000) for _ in range(160)]
    prompts = [shared + [rng.randrange(1, 1000) for _ in range(rng.randint(1, 200))] for _ in range(10)]
    prompts += [[rng.randrange(1, 1000) for _ in range(rng.randint(300, 700))] for _ in range(4)]
    llm = ponytail.LLM(model, kv_cache_memory="64MiB", max_num_seqs=8, max_model_len=1024,
                       max_num_batched_tokens=256,  # 256: the long prompts prefill in chunks
                       prefill_attention=prefill_attention)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert llm.stats().prefix_cache_hits > 0
    checked = 0
    model.set_attn_implementation("sdpa")  # LLM switched it to "ponytail"
    with torch.no_grad():
        for prompt, output in zip(prompts, outputs):
            logits = model(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
            top2 = logits.topk(2)
            if (top2.values[0] - top2.values[1]).item() < 0.5:
                continue  # a near tie: bf16 rounding may pick either
            checked += 1
            assert output.token_ids == [int(top2.indices[0])]
    assert checked >= len(prompts) // 2
    assert bool(calls) == (prefill_attention == "fa4")
    assert bool(paged_calls) == (prefill_attention == "fa4" and fa4.fa4_pages_problem() is None)


def test_fa4_kernels_are_ready_when_llm_returns(monkeypatch):
    """LLM()'s warm-up (ModelRunner.warm_up) compiles, or loads from its disk cache, every
    FlashAttention-4 kernel the steps need: new prompts, chunks after a context, prefix hits and rows
    on both sides of its 128-row tile; no request waits for a compile."""
    from ponytail.attention import fa4

    monkeypatch.setenv("PONYTAIL_KERNELS", "cupy")
    if problem := fa4.fa4_problem(torch.device("cuda"), torch.bfloat16, 128):
        pytest.skip(f"FlashAttention-4 cannot run here: {problem}")
    from flash_attn.cute.interface import _flash_attn_fwd

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=1000, max_position_embeddings=2048)  # head_dim 128
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    llm = ponytail.LLM(model, kv_cache_memory="64MiB", max_num_seqs=8, max_model_len=2048,
                       max_num_batched_tokens=256, prefill_attention="fa4", compile_model=True, cuda_graphs=True)
    ready = set(_flash_attn_fwd.compile_cache.cache)
    assert ready, "LLM() returned without a FlashAttention-4 kernel in memory"
    rng = random.Random(2)
    shared = [rng.randrange(1, 1000) for _ in range(300)]
    prompts = [shared + [rng.randrange(1, 1000) for _ in range(rng.randint(1, 90))] for _ in range(6)]
    prompts += [[rng.randrange(1, 1000) for _ in range(n)] for n in (3, 40, 129, 700, 1500)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert all(o.error is None and len(o.token_ids) == 4 for o in outputs)
    assert llm.stats().prefix_cache_hits > 0
    assert set(_flash_attn_fwd.compile_cache.cache) == ready


@pytest.mark.parametrize("fuse_projections,column_major", [(False, False), (True, False), (True, True)])
def test_compiled_layers_with_cuda_graphs_keep_greedy_output(monkeypatch, fuse_projections, column_major):
    """compile_model=True: inductor's fused kernels captured in the decode graphs, fp32; with
    fuse_projections, one GEMM for q/k/v and gate/up traced and captured too; with
    column_major_weights, those GEMMs on column-major weights through cuBLASLt."""
    from ponytail.runner.compile import restore_decoder_layers
    from ponytail.runner.fused_projections import unfuse_projections

    monkeypatch.setenv("PONYTAIL_KERNELS", "cupy")
    model = small_model()
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(5, 200))] for _ in range(6)]
    expected = []
    for p in prompts:
        out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    llm = ponytail.LLM(model, kv_cache_memory="64MiB", max_num_seqs=8, max_model_len=512, compile_model=True,
                       tuning={"fuse_projections": fuse_projections, "column_major_weights": column_major})
    try:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    finally:
        restore_decoder_layers(model)
        unfuse_projections(model)
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.runner.graphs.replays > 0 and llm.stats().used_blocks == 0


def test_async_scheduling_equals_sync_with_cuda_graphs(monkeypatch):
    """Step N+1 launched before step N's tokens reach the host: same tokens, stops mid-batch."""
    monkeypatch.setenv("PONYTAIL_KERNELS", "cupy")
    model = small_model()
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(5, 200))] for _ in range(12)]

    def run(params, async_scheduling):
        llm = ponytail.LLM(model, kv_cache_memory="64MiB", max_num_seqs=8, max_model_len=512,
                           max_num_batched_tokens=512, cuda_graphs=True, async_scheduling=async_scheduling)
        assert llm.engine.async_scheduling == bool(async_scheduling is None or async_scheduling)
        outputs = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
        assert llm.stats().used_blocks == 0 and llm.engine.cache.invariants() == []
        assert llm.engine.runner.graphs.replays > 0
        return outputs

    full = run(SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), False)
    # Half the prompts stop on a token of their own output (known only after the sync), the rest by length.
    params = [SamplingParams(max_tokens=rng.randint(4, 24), temperature=0, ignore_eos=True,
                             stop_token_ids=[tokens[rng.randrange(1, 4)]] if i % 2 else None)
              for i, (tokens, _) in enumerate(full)]
    assert run(params, None) == run(params, False)  # None: on, on a CUDA device


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_parallel_samples_share_the_prompt_on_gpu(monkeypatch, cuda_graphs):
    """n > 1 with async scheduling: the forked samples read the prompt's shared blocks (a partial
    last block copied on the device when each first writes), and take their inputs on the device."""
    monkeypatch.setenv("PONYTAIL_KERNELS", "cupy")
    model = small_model()
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 1000) for _ in range(length)] for length in (37, 48, 203)]
    # Plain greedy first: the engine switches the model it owns to Ponytail's attention.
    expected = [model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=20, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist() for prompt in prompts]
    llm = ponytail.LLM(model, kv_cache_memory="64MiB", max_num_seqs=16, max_model_len=512,
                       max_num_batched_tokens=512, cuda_graphs=cuda_graphs)
    assert llm.engine.async_scheduling
    greedy = llm.generate(prompts, SamplingParams(n=4, max_tokens=20, temperature=0, ignore_eos=True))
    for want, out in zip(expected, greedy):
        assert [o.token_ids for o in out.outputs] == [want] * 4
    seeded = SamplingParams(n=4, max_tokens=20, temperature=1.0, seed=9, ignore_eos=True)
    first = [[o.token_ids for o in out.outputs] for out in llm.generate(prompts, seeded)]
    again = [[o.token_ids for o in out.outputs] for out in llm.generate(prompts, seeded)]
    assert first == again and all(len({tuple(t) for t in samples}) == 4 for samples in first)
    assert llm.stats().used_blocks == 0 and llm.engine.cache.invariants() == []
    assert llm.engine.scheduler.promises.total == 0


def word_tokenizer(vocab_size: int):
    """A tokenizer for a checkpoint directory: one word per id, no files from anywhere."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", pad_token="w0", eos_token="w1")


def test_llm_from_a_directory_compiles_and_fuses_by_default(monkeypatch, tmp_path):
    """LLM(path) on CUDA: compile_model, fuse_projections and column_major_weights on by default, same
    greedy tokens."""
    monkeypatch.setenv("PONYTAIL_KERNELS", "cupy")
    model = small_model()
    model.save_pretrained(tmp_path)
    word_tokenizer(model.config.vocab_size).save_pretrained(tmp_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 1000) for _ in range(rng.randint(5, 200))] for _ in range(4)]
    expected = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    llm = ponytail.LLM(str(tmp_path), dtype=torch.float32, kv_cache_memory="64MiB", max_num_seqs=4,
                       max_model_len=512)
    loaded = llm.engine.model
    attn = loaded.model.layers[0].self_attn
    assert "forward" in vars(loaded.model.layers[0])  # compiled
    assert "forward" in vars(attn.q_proj) and "forward" in vars(loaded.model.layers[0].mlp.up_proj)  # fused
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
    assert is_column_major(attn.q_proj.weight) and is_column_major(loaded.model.layers[0].mlp.down_proj.weight)
    libraries = []  # the BLAS preference inside the model's calls (prompt steps run eagerly)
    loaded.model.layers[0].register_forward_pre_hook(
        lambda *_: libraries.append(torch.backends.cuda.preferred_blas_library()))
    before = torch.backends.cuda.preferred_blas_library()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.runner.graphs.replays > 0
    assert libraries and set(libraries) == {torch._C._BlasBackend.Cublaslt}
    assert torch.backends.cuda.preferred_blas_library() == before  # the rest of the process keeps its own


def test_logprobs_on_gpu_carry_vllm_ranks(monkeypatch):
    """The sampler's rank of a sampled token (tokens at least as likely), read back with the logprobs."""
    monkeypatch.setenv("PONYTAIL_KERNELS", "cupy")
    model = small_model()
    prompt = list(range(5, 45))
    llm = ponytail.LLM(model, kv_cache_memory="64MiB", max_num_seqs=8, max_model_len=512)
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=2.0, seed=5, logprobs=2,
                                              ignore_eos=True))[0]
    tokens = out.outputs[0].token_ids
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt + tokens], device="cuda")).logits[0].float().log_softmax(-1)
    for step, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        dist = logprobs[len(prompt) - 1 + step]
        assert isinstance(entry[token], ponytail.Logprob) and entry[token].decoded_token is None  # no tokenizer
        # Counted on the engine's logits: a token within float noise of the chosen one may count or not.
        low, high = int((dist > dist[token] + 1e-3).sum()) + 1, int((dist >= dist[token] - 1e-3).sum())
        assert low <= entry[token].rank <= high


def test_beam_search_on_gpu_equals_transformers_beam_search(monkeypatch):
    """LLM.beam_search's one-token steps (prefix cache hits, graph replays where a step only
    decodes) find transformers' num_beams sequences, fp32, with EOS out of play."""
    monkeypatch.setenv("PONYTAIL_KERNELS", "cupy")
    model = small_model()
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 1000) for _ in range(n)] for n in (45, 130)]
    expected = [model.generate(torch.tensor([p], device="cuda"), num_beams=4, num_return_sequences=4,
                               max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                               length_penalty=0.0).tolist() for p in prompts]
    llm = ponytail.LLM(model, kv_cache_memory="64MiB", max_num_seqs=16, max_model_len=512)
    got = llm.beam_search(prompts, ponytail.BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True))
    assert [[s.tokens for s in output.sequences] for output in got] == expected
    stats = llm.stats()
    assert stats.used_blocks == 0 and stats.prefix_cache_hits > 0 and llm.engine.cache.invariants() == []


def test_tracked_logprobs_and_a_thinking_budget_on_gpu_with_graphs_and_async_scheduling(monkeypatch):
    """logprob_token_ids gathered on the device; a spent thinking budget forces </think> into the
    token the next (graph-replayed, asynchronously launched) step reads as its input."""
    monkeypatch.setenv("PONYTAIL_KERNELS", "cupy")
    model = small_model()
    tokenizer = word_tokenizer(1000)
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=True)  # ids 1000, 1001: the model's vocab is 1,002
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)  # small rows: never a greedy choice alone
    start, end = 1000, 1001
    llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="64MiB", max_num_seqs=8, max_model_len=512)
    assert llm.engine.async_scheduling
    prompt = list(range(5, 45)) + [start]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    assert end not in free
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, thinking_token_budget=4,
                                                logprob_token_ids=[7, end]))[0]
    ids = out.token_ids
    assert ids[:4] == free[:4] and ids[4] == end and end not in ids[5:]
    assert ids[5:] == llm.generate([prompt + ids[:5]], SamplingParams(max_tokens=7, temperature=0,
                                                                       ignore_eos=True))[0].token_ids
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt + ids], device="cuda")).logits[0].float().log_softmax(-1)
    for step, entry in enumerate(out.outputs[0].logprobs):
        assert set(entry) == {ids[step], 7, end}
        for token in (7, end):
            assert entry[token] == pytest.approx(logprobs[len(prompt) - 1 + step, token].item(), abs=2e-3)
    assert llm.engine.runner.graphs.replays > 0 and llm.stats().used_blocks == 0
