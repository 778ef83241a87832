"""A step's sampling settings as per-row tensors: `SamplingBatch.build` turns the step's
SamplingParams and token histories into them once, on the logits' device (sampler.py uses them)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from ..utils.device import to_device
from .bans import masked_tokens
from .params import SamplingParams

Pairs = tuple[torch.Tensor, torch.Tensor]  # (row index, token id), flat, int64, on the device


def _tensor(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(data, dtype=dtype), device)


def _pairs(ids: list[list[int]], device: torch.device) -> tuple[Pairs, int]:
    """Flat (row, token) pairs of ragged id lists (a scatter index needing no vocab size), and
    the largest id (-1 if none). The host work is O(tokens) per step, in C loops."""
    lengths = [len(seq) for seq in ids]
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=sum(lengths))
    rows = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor(lengths))
    largest = int(flat.max()) if flat.size else -1
    return (to_device(rows, device), to_device(torch.from_numpy(flat), device)), largest


@dataclass
class SamplingBatch:
    """One step's sampling settings as per-row tensors; a field is None when no row needs it."""

    rows: int  # rows of the logits this batch samples
    greedy: torch.Tensor | None  # [rows] bool; None when every row or no row is greedy
    all_greedy: bool  # every row takes the argmax: no temperature, filters or random draw
    temperature: torch.Tensor | None  # [rows] float32, greedy rows hold 1; None if all greedy
    min_p: torch.Tensor | None  # [rows] float32; None when no sampled row sets min_p
    top_k: torch.Tensor | None  # [rows] int64, 0 = off; None when no sampled row sets top_k
    max_top_k: int  # largest top_k, so top-k alone needs no full sort; 0 when top_k is None
    top_p: torch.Tensor | None  # [rows] float32; None when no sampled row sets top_p < 1
    repetition_penalty: torch.Tensor | None  # [rows, 1] float32; None when every row has 1
    presence_penalty: torch.Tensor | None  # [rows, 1] float32; None when every row has 0
    frequency_penalty: torch.Tensor | None  # [rows, 1] float32; None when every row has 0
    prompt_tokens: Pairs | None  # prompt ids, only for the repetition penalty
    output_tokens: Pairs | None  # generated ids, for any penalty
    masked_tokens: Pairs | None  # tokens rows may not take this step (min_tokens, bad_words: bans.py)
    generators: dict[int, torch.Generator]  # sampled rows with their own generator
    any_unseeded: bool  # some sampled row draws from the global generator
    max_logprobs: int | None  # most top logprobs a row asked for; None when no row asked
    max_token_id: int  # largest token id indexed above; must be < vocab size
    grammar_rows: torch.Tensor | None = None  # [c] int64: rows constrained by a grammar
    grammar_bitmask: torch.Tensor | None = None  # [c, ceil(vocab/32)] int32: bit t = token t allowed
    logit_bias: tuple[Pairs, torch.Tensor] | None = None  # (row, token) pairs, float32 bias added to each
    allowed: tuple[torch.Tensor, Pairs] | None = None  # rows with allowed_token_ids, (i-th such row, token)
    bad_words: bool = False  # some row has bad words: its masked tokens follow its output
    tracked_token_ids: torch.Tensor | None = None  # [rows, m] int64: each row's logprob_token_ids, 0-padded
    forced_tokens: torch.Tensor | None = None  # [rows] int64: the token a row must take, -1 for its draw

    @property
    def writes_logits(self) -> bool:
        """Sampling changes the logits it works on (masks, bias, penalties, temperature): it
        needs its own copy. A greedy batch with none of them reads the model's logits as they are."""
        return (not self.all_greedy or self.masked_tokens is not None or self.grammar_rows is not None
                or self.logit_bias is not None or self.output_tokens is not None or self.allowed is not None)

    @property
    def changes_per_step(self) -> bool:
        """It holds what the next step may change: the rows' token histories (penalties), masked
        tokens (rows still short of min_tokens, bad words) or grammar bitmasks."""
        return (self.output_tokens is not None or self.masked_tokens is not None or self.grammar_rows is not None
                or self.bad_words or self.forced_tokens is not None)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        device: torch.device | str,
        eos_token_id: int | Collection[int] | None = None,
        token_bitmask: tuple[list[int], torch.Tensor] | None = None,
        forced_tokens: list[int] | None = None,
    ) -> SamplingBatch:
        """Per-row tensors for one step. Row i of every list is row i of the logits.

        generators[i] must be the request's own generator when params[i].seed is set (see
        request_generator); eos_token_id (one id or several) is masked, with stop_token_ids,
        in rows that have fewer than min_tokens output tokens (unless ignore_eos). token_bitmask
        is (rows, host int32 bitmask) from sampling.grammar.token_bitmask: those rows may only
        take the tokens whose bit is set. forced_tokens: per row the token it takes (-1: its draw),
        given where some row has a thinking budget (sampling.thinking), so the batch is rebuilt each step.
        """
        device = torch.device(device)
        rows = len(params)
        for name, value in (("output_token_ids", output_token_ids),
                            ("prompt_token_ids", prompt_token_ids), ("generators", generators)):
            if len(value) != rows:
                raise ValueError(f"{name} has {len(value)} rows; params has {rows}")
        greedy = [p.greedy for p in params]
        num_sampled = greedy.count(False)
        own = _own_generators(params, generators, greedy, device)
        repetition = _penalty_column(params, "repetition_penalty", 1.0, device)
        presence = _penalty_column(params, "presence_penalty", 0.0, device)
        frequency = _penalty_column(params, "frequency_penalty", 0.0, device)
        any_penalty = repetition is not None or presence is not None or frequency is not None
        prompt_pairs, output_pairs, largest_seen = _history_pairs(
            prompt_token_ids if repetition is not None else None, output_token_ids if any_penalty else None, device)
        banned = masked_tokens(params, output_token_ids, eos_token_id)
        mask_pairs, largest_stop = _pairs(banned, device) if any(banned) else (None, -1)
        allowed, largest_allowed = _allowed(params, device)
        bias, largest_bias = _logit_bias(params, device)
        # Rows that track tokens get their logprobs instead of the top ones.
        asked = [0 if p.logprob_token_ids else p.logprobs for p in params if p.logprobs is not None]
        tracked, largest_tracked = _tracked(params, device)
        return cls(
            rows=rows,
            greedy=_column(greedy, device, torch.bool) if any(greedy) and num_sampled else None,
            all_greedy=not num_sampled,
            temperature=_column([1.0 if g else p.temperature for p, g in zip(params, greedy)], device)
            if num_sampled else None,
            min_p=_sampled_column(params, greedy, "min_p", 0.0, device),
            top_k=_sampled_column(params, greedy, "top_k", 0, device, torch.int64),
            max_top_k=max((0 if g else p.top_k for p, g in zip(params, greedy)), default=0),
            top_p=_sampled_column(params, greedy, "top_p", 1.0, device),
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            prompt_tokens=prompt_pairs,
            output_tokens=output_pairs,
            masked_tokens=mask_pairs,
            generators=own,
            any_unseeded=len(own) < num_sampled,
            max_logprobs=max(asked) if asked else None,
            max_token_id=max(largest_seen, largest_stop, largest_bias, largest_allowed, largest_tracked),
            grammar_rows=None if token_bitmask is None else _tensor(token_bitmask[0], torch.int64, device),
            grammar_bitmask=None if token_bitmask is None else to_device(token_bitmask[1], device),
            logit_bias=bias,
            allowed=allowed,
            bad_words=any(p.bad_words_token_ids for p in params),
            tracked_token_ids=tracked,
            forced_tokens=None if forced_tokens is None else _tensor(forced_tokens, torch.int64, device),
        )


def _tracked(params: list[SamplingParams], device: torch.device) -> tuple[torch.Tensor | None, int]:
    """[rows, m] logprob_token_ids, padded with token 0 (rows read only their own), and the largest id."""
    lists = [p.logprob_token_ids or [] for p in params]
    width = max(map(len, lists), default=0)
    if not width:
        return None, -1
    padded = [ids + [0] * (width - len(ids)) for ids in lists]
    return _tensor(padded, torch.int64, device), max(max(ids, default=-1) for ids in lists)


def _column(values: list, device: torch.device, dtype=torch.float32, shape=(-1,)) -> torch.Tensor:
    return _tensor(values, dtype, device).view(shape)


def _sampled_column(params: list[SamplingParams], greedy: list[bool], field: str, off: float,
                    device: torch.device, dtype=torch.float32) -> torch.Tensor | None:
    """Per-row values of a filter field (greedy rows hold `off`); None when every row is off."""
    values = [off if g else getattr(p, field) for p, g in zip(params, greedy)]
    return _column(values, device, dtype) if any(v != off for v in values) else None


def _penalty_column(params: list[SamplingParams], field: str, off: float, device: torch.device) -> torch.Tensor | None:
    """[rows, 1] values of a penalty field; None when every row has `off` (no penalty)."""
    values = [getattr(p, field) for p in params]
    return _column(values, device, shape=(-1, 1)) if any(v != off for v in values) else None


def _own_generators(params: list[SamplingParams], generators: list[torch.Generator | None], greedy: list[bool],
                    device: torch.device) -> dict[int, torch.Generator]:
    """The sampled rows that draw from their own generator; a seeded row must bring one, on `device`."""
    own = {}
    for i, (p, gen, g) in enumerate(zip(params, generators, greedy)):
        if p.seed is not None and gen is None:
            raise ValueError(f"row {i} has seed={p.seed} but no generator; "
                             "pass request_generator(params, device), kept per request")
        if gen is not None and not g:
            if gen.device.type != device.type:
                raise ValueError(f"row {i}'s generator is on {gen.device}, not {device}")
            own[i] = gen
    return own


def _history_pairs(prompt_token_ids: list[list[int]] | None, output_token_ids: list[list[int]] | None,
                   device: torch.device) -> tuple[Pairs | None, Pairs | None, int]:
    """The token histories penalties read, as pairs (None: not needed), and the largest id in them
    (-1 if none): prompts for the repetition penalty only, outputs for any penalty."""
    prompt_pairs = output_pairs = None
    largest = -1
    if prompt_token_ids is not None:
        prompt_pairs, seen = _pairs(prompt_token_ids, device)
        largest = max(largest, seen)
    if output_token_ids is not None:
        output_pairs, seen = _pairs(output_token_ids, device)
        largest = max(largest, seen)
    return prompt_pairs, output_pairs, largest


def _logit_bias(params: list[SamplingParams], device: torch.device) -> tuple[tuple[Pairs, torch.Tensor] | None, int]:
    """logit_bias as (row, token) pairs and their float32 values (None: no row has one), and the
    largest biased token id (-1 if none)."""
    if not any(p.logit_bias for p in params):
        return None, -1
    pairs, largest = _pairs([list(p.logit_bias or ()) for p in params], device)
    values = [v for p in params for v in (p.logit_bias or {}).values()]
    return (pairs, _tensor(values, torch.float32, device)), largest


def _allowed(params: list[SamplingParams], device: torch.device) -> tuple[tuple[torch.Tensor, Pairs] | None, int]:
    """The rows with allowed_token_ids and their tokens as pairs (None: no such row), and the
    largest id (-1 if none)."""
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return None, -1
    pairs, largest = _pairs([params[i].allowed_token_ids for i in rows], device)
    return (_tensor(rows, torch.int64, device), pairs), largest
