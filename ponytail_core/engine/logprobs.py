"""Logprobs the engine records: a sampled token's entry, and the prompt positions a step computed
(scored right after its forward pass)."""

from __future__ import annotations

import torch

from ..runner.inputs import ScheduledChunk
from ..runner.model_runner import prompt_logit_positions
from ..sampling.logprob import Logprob, TokenTexts, prompt_logprobs
from ..sampling.params import SamplingParams


def record_prompt_logprobs(chunks: list[ScheduledChunk], logits: torch.Tensor, num_sampling: int,
                           texts: TokenTexts) -> torch.Tensor:
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
        for token, logprob in entry.items():
            logprob.decoded_token = texts(token)
        request.prompt_logprobs.append(entry)
    return logits[:num_sampling]


def logprob_entry(result, row: int, token: int, chosen: float, params: SamplingParams,
                  texts: TokenTexts) -> dict[int, Logprob]:
    """{token id: Logprob} for the chosen token and the row's `params.logprobs` most likely ones
    (rank 1 to top), or its logprob_token_ids' (whose rank is not computed: None)."""
    rank = result.rank_list[row] if result.rank_list is not None else None
    entry = {token: Logprob(chosen, rank, texts(token))}
    if params.logprob_token_ids:
        for index, value in zip(params.logprob_token_ids, result.tracked[row].tolist()):
            entry.setdefault(index, Logprob(value, None, texts(index)))
    elif result.top_logprobs is not None and params.logprobs:  # host tensors (HostSamples)
        values, indices = result.top_logprobs
        top = params.logprobs
        for position, (value, index) in enumerate(zip(values[row, :top].tolist(), indices[row, :top].tolist())):
            if index not in entry:
                entry[index] = Logprob(value, position + 1, texts(index))
    return entry
