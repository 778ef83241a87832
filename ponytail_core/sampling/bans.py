"""Tokens a row may not take: vLLM's allowed_token_ids, bad_words and min_tokens masks.

- min_tokens: a row short of it may not take its stop tokens or EOS (unless ignore_eos).
- bad_words: a word's last token is banned where the output so far ends with the rest of the
  word's tokens (vLLM's rule: only the output counts, not the prompt). Each word is tokenized on
  its own and after a space, so it is caught at the start of the text and inside it.
- allowed_token_ids: every other token is banned.

Masked logits become -inf before logit_bias and the penalties; logprobs stay the raw model's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from numbers import Integral

import torch

from ..errors import ConfigError
from .params import SamplingParams


def checked_token_bans(params: SamplingParams, tokenizer, vocab_size: int) -> SamplingParams:
    """params for an engine: bad_words tokenized into bad_words_token_ids (ConfigError without a
    tokenizer), and every token id the params name checked against the vocabulary."""
    if params.bad_words:
        if tokenizer is None:
            raise ConfigError(f"bad_words={params.bad_words!r:.80} needs a tokenizer, but this engine has none; "
                              "use bad_words_token_ids")
        sequences = (params.bad_words_token_ids or []) + tokenize_bad_words(tokenizer, params.bad_words)
        params = dataclasses.replace(params, bad_words=None, bad_words_token_ids=sequences or None)
    for name, ids in params.named_token_ids.items():
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise ConfigError(f"{name}={outside[:5]!r:.80} are outside the vocabulary: allowed: token ids in "
                              f"[0, {vocab_size})")
    return params


def tokenize_bad_words(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """Each word's token ids as written, plus after a space where that spells the same word with
    another first token and as many tokens (a word-initial token, as in " Paris")."""
    sequences: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            continue
        sequences.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            sequences.append(spaced)
    return sequences


def bad_word_endings(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The last tokens of the bad words whose other tokens end `output` (every one-token word)."""
    banned = []
    for sequence in sequences:
        prefix = len(sequence) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or list(output[-prefix:]) == list(sequence[:-1]):
            banned.append(sequence[-1])
    return banned


def masked_tokens(params: list[SamplingParams], output_token_ids: list[list[int]],
                  eos_token_id: int | Collection[int] | None) -> list[list[int]]:
    """Per row, the tokens it may not take this step: its stop tokens and EOS while short of
    min_tokens, and the endings of its bad words."""
    eos = ([] if eos_token_id is None else [int(eos_token_id)]
           if isinstance(eos_token_id, Integral) else sorted(eos_token_id))
    rows = []
    for p, out in zip(params, output_token_ids):
        banned = p.stop_token_ids + ([] if p.ignore_eos else eos) if len(out) < p.min_tokens else []
        if p.bad_words_token_ids:
            banned = banned + bad_word_endings(p.bad_words_token_ids, out)
        rows.append(banned)
    return rows


def keep_only_allowed(logits: torch.Tensor, rows: torch.Tensor, allowed: tuple[torch.Tensor, torch.Tensor]) -> None:
    """logits[rows[i]] keep only the tokens of allowed (pairs (i, token)); the rest become -inf.
    In place, no host sync."""
    keep = torch.zeros((rows.shape[0], logits.shape[1]), dtype=torch.bool, device=logits.device)
    keep.index_put_(allowed, keep.new_ones(()))
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~keep, float("-inf")))
