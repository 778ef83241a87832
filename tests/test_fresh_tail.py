"""A step's chunks after a context go first; on CUDA those after the last one with context form a
tail that attends its own K/V (runner/step_cache.FreshTail). The GPU tests run both halves."""

import torch

from ponytail.attention.chunks import ChunkRun, SdpaShapes
from ponytail.runner.model_runner import ModelRunner


def runner_on(device: str) -> ModelRunner:
    runner = object.__new__(ModelRunner)  # only the device and _tensor are used
    runner.device = torch.device(device)
    return runner


def test_the_tail_is_every_chunk_after_the_last_one_with_context():
    runner = runner_on("cpu")
    rows = [(0, 5), (30, 6), (0, 24), (0, 24), (0, 7)]
    cu = [0, 5, 11, 35, 59, 66]
    tail = runner._fresh_tail(rows, cu)
    assert (tail.chunks, tail.tokens, tail.max_query_len, tail.num_keys) == (2, 11, 6, 41)
    assert tail.cu_seq_q.tolist() == [0, 24, 48, 55] and tail.cu_seq_q.dtype == torch.int32
    assert tail.tail_max_query_len == 24
    assert tail.runs == [ChunkRun(0, 2, 24), ChunkRun(48, 1, 7)]
    assert runner._fresh_tail([(0, 5), (30, 6)], [0, 5, 11]) is None  # nothing follows the last context


def test_only_cuda_steps_split_and_only_with_both_kinds():
    cuda = runner_on("cuda")  # host tensors stand in for the device's: only the plan is checked
    cuda._tensor = lambda values, dtype: torch.tensor(values, dtype=dtype)
    cuda.sdpa_shapes = SdpaShapes()
    chunks = cuda._prefill_chunks([(16, 4), (0, 8), (0, 8)], [[0, 1], [2], [3]], start=3)
    assert chunks.runs is None and chunks.cu_seq_q.tolist() == [0, 4, 12, 20]
    assert (chunks.tail.chunks, chunks.tail.tokens, chunks.tail.runs) == (1, 4, [ChunkRun(0, 2, 8)])
    assert cuda._prefill_chunks([(0, 4), (16, 8)], [[0], [1, 2]], start=0).tail is None  # context last
    fresh = cuda._prefill_chunks([(0, 4), (0, 8)], [[0], [1]], start=0)  # none has context: no split needed
    assert fresh.tail is None and fresh.runs == [ChunkRun(0, 1, 4), ChunkRun(4, 1, 8)]
    cpu = runner_on("cpu")
    cpu.sdpa_shapes = SdpaShapes()
    assert cpu._prefill_chunks([(16, 4), (0, 8)], [[0, 1], [2]], start=0).tail is None  # torch plans every row
