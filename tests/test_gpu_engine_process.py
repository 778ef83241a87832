"""ProcessAsyncLLM on a GPU: the engine's child process builds its own CUDA context and streams the
same greedy tokens as plain transformers (fp32, no near ties)."""

import asyncio
import random

import pytest
import torch
from test_gpu_engine import small_model

import ponytail
from ponytail import SamplingParams

pytestmark = pytest.mark.gpu


def test_the_engine_process_streams_plain_generates_tokens_on_gpu():
    model = small_model()
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(5, 300))] for _ in range(8)]
    expected = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    engine = ponytail.ProcessAsyncLLM(dict(model=model, kv_cache_memory="64MiB", max_num_seqs=8, max_model_len=512,
                                           max_num_batched_tokens=512), stream_interval_s=0.01)
    try:
        assert engine.device.type == "cuda" and engine.device_uuid == str(torch.cuda.get_device_properties(0).uuid)

        async def one(prompt):
            tokens = []
            async for delta in engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)):
                tokens += delta.new_token_ids
            return tokens

        async def main():
            return await asyncio.gather(*[one(p) for p in prompts])

        assert asyncio.run(main()) == expected
        assert engine.num_steps > 0
    finally:
        engine.shutdown()
