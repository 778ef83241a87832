"""Logprobs the engine records: a sampled token's entry, and the prompt positions a step computed
(scored right after its forward pass)."""

from __future__ import annotations

import torch

from ..runner.inputs import ScheduledChunk
from ..runner.model_runner import prompt_logit_positions
from ..sampling.sampler import prompt_logprobs


def record_prompt_logprobs(chunks: list[ScheduledChunk], logits: torch.Tensor, num_sampling: int) -> torch.Tensor:
    """Score the prompt positions this step computed for requests that asked for prompt
    logprobs (their logits follow the sampling rows); returns the sampling rows."""
    positions = prompt_logit_positions(chunks)
    if not positions:
        return logits
    requests = [chunk.request for chunk, _ in positions]
    entries = prompt_logprobs(logits[num_sampling:], [r.prompt_token_ids[p + 1] for r, (_, p) in
                                                      zip(requests, positions)],
                              [r.params.prompt_logprobs for r in requests])
    for request, entry in zip(requests, entries):
        request.prompt_logprobs.append(entry)
    return logits[:num_sampling]


def logprob_entry(result, row: int, token: int, chosen: float, top: int) -> dict[int, float]:
    """{token id: logprob} for the chosen token and the row's `top` most likely ones."""
    entry = {token: chosen}
    if result.top_logprobs is not None and top:  # host tensors (HostSamples)
        values, indices = result.top_logprobs
        for value, index in zip(values[row, :top].tolist(), indices[row, :top].tolist()):
            entry.setdefault(index, value)
    return entry
