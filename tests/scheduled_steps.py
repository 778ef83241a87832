"""An engine on a tiny random Llama (token ids only, no tokenizer) and a record of what each of its
steps holds: for tests of what the scheduler puts in a step."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ponytail
from ponytail import SamplingParams


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
    return LlamaForCausalLM(config).eval()


def engine_on(model, **options):
    """LLM(model)'s engine with a 16 MiB pool and 4 seats; every token counts one budget unit (the CPU's
    default counts context too)."""
    llm = ponytail.LLM(model, kv_cache_memory="16MiB", max_num_seqs=4, max_model_len=512, **options)
    llm.engine.scheduler.context_cost = 0.0
    return llm.engine


def add(engine, name: str, prompt: list[int], max_tokens: int, **params):
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **params),
                       request_id=name)


def own_prompt(name: str, length: int) -> list[int]:
    """Token ids no other name's prompt shares (no prefix-cache hits between them)."""
    first = 100 * (ord(name) - ord("a")) + 1
    return list(range(first, first + length))


def run_steps(engine) -> list[list[tuple[str, int]]]:
    """Every step until the engine is idle: what the scheduler put in it, (request id, tokens)."""
    seen = []
    schedule = engine.scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if out is not None and out.chunks:
            seen.append([(c.request.request_id, c.num_tokens) for c in out.chunks])
        return out

    engine.scheduler.schedule = recording
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.scheduler.schedule = schedule
    return seen
