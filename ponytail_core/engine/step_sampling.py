"""Each step's SamplingBatch for the engine; the previous step's is reused while it cannot differ."""

from __future__ import annotations

import functools
import operator

import torch

from ..sampling.grammar import token_bitmask
from ..sampling.params import SamplingParams
from ..sampling.sampler import SamplingBatch
from ..sampling.bans import checked_token_bans
from ..sampling.thinking import ThinkingBudget, ThinkingTags, check_thinking_budget
from .request import Request

IGNORED_ROW = SamplingParams(temperature=0)  # the row of a request that ended before its step sampled


class StepBatches:
    """Builds the sampling batch of a step's rows (their requests, in row order).

    The previous step's batch is reused while the rows are the same live requests in the same
    order and the batch holds nothing that changes from step to step (token histories for
    penalties, min_tokens masks, grammar bitmasks): everything else in it follows from the rows'
    params and generators, which a request keeps for its life. Decoding hundreds of unchanged
    requests, a rebuild walked them a dozen times a step for identical tensors and copied its
    columns to the device again.
    """

    def __init__(self, generators: dict[str, torch.Generator | None], eos_token_ids: set[int], tokenizer=None):
        self.generators = generators  # the engine's: request id -> the request's own generator
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.num_built = 0
        self.num_reused = 0
        self._rows: list[Request] = []  # the kept batch's requests (held, so none is a new object)
        self._batch: SamplingBatch | None = None

    @functools.cached_property
    def thinking_tags(self) -> ThinkingTags | None:
        """The model's <think> and </think>, looked up (the whole vocabulary) only once a request
        has a thinking budget: not at every engine's start."""
        return ThinkingTags.of(self.tokenizer)

    def checked(self, params: SamplingParams, vocab_size: int) -> SamplingParams:
        """A request's params as this engine samples them: bad_words tokenized, the token ids they
        name inside the vocabulary, a thinking budget only where the model has thinking tags."""
        if params.thinking_token_budget is not None:
            check_thinking_budget(params, self.thinking_tags)
        return checked_token_bans(params, self.tokenizer, vocab_size)

    def build(self, requests: list[Request], live: list[bool], vocab_size: int,
              device: torch.device) -> SamplingBatch:
        """The batch for these rows; `live[i]`: request i still runs (a finished row samples
        greedily, for nobody)."""
        kept = self._batch
        if (kept is not None and len(requests) == len(self._rows) and all(map(operator.is_, requests, self._rows))
                and all(live)):
            self.num_reused += 1
            return kept
        grammars = [r.grammar if ok else None for r, ok in zip(requests, live)]
        batch = SamplingBatch.build([r.params if ok else IGNORED_ROW for r, ok in zip(requests, live)],
                                    [r.output_token_ids if ok else [] for r, ok in zip(requests, live)],
                                    [r.prompt_token_ids for r in requests],
                                    [self.generators[r.request_id] if ok else None for r, ok in zip(requests, live)],
                                    device, eos_token_id=sorted(self.eos_token_ids) or None,
                                    token_bitmask=token_bitmask(grammars, vocab_size),
                                    forced_tokens=self._forced(requests, live))
        self.num_built += 1
        reusable = all(live) and not batch.changes_per_step
        self._batch, self._rows = (batch, list(requests)) if reusable else (None, [])
        return batch

    def _forced(self, requests: list[Request], live: list[bool]) -> list[int] | None:
        """Per row the token a spent thinking budget makes it take (-1: its draw); None when no row
        has a budget. The rows' new tokens must be known (the engine reads such a step back first)."""
        if not any(r.params.thinking_token_budget is not None for r in requests):
            return None
        forced = []
        for request, ok in zip(requests, live):
            budget = request.params.thinking_token_budget
            if not ok or budget is None:
                forced.append(-1)
                continue
            if request.thinking is None:
                request.thinking = ThinkingBudget(self.thinking_tags, budget, request.prompt_token_ids)
            forced.append(request.thinking.forced_token(request.output_token_ids))
        return forced
