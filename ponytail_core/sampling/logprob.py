"""One entry of a token's logprobs, as vLLM's outputs give it: `.logprob`, `.rank`, `.decoded_token`,
the token texts those entries carry, and the prompt positions' entries.

A Logprob is also the float it holds, so code that took Ponytail's earlier `{token id: float}`
entries (arithmetic, JSON, pydantic float fields) keeps working unchanged.
"""

from __future__ import annotations

import torch


class Logprob(float):
    """A log-probability (a float) with vLLM's fields: rank (in the raw distribution, the tokens at
    least as likely, itself included: 1 for the most likely) and decoded_token (the token's text,
    None without a tokenizer)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    __str__ = float.__repr__  # str() and f-strings print the number, as for the float it was

    def __reduce__(self):  # pickled with its fields (Ray, the engine's process)
        return Logprob, (float(self), self.rank, self.decoded_token)


class TokenTexts:
    """Each token id decoded on its own (vLLM's Logprob.decoded_token, OpenAI's logprob `token`),
    memoized: logprobs repeat the same few thousand ids, and decode() is the costly part. None for
    every id without a tokenizer."""

    def __init__(self, tokenizer, limit: int = 1 << 16):
        self.tokenizer = tokenizer
        self.limit = limit
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._texts) < self.limit:
                self._texts[token_id] = text
        return text


def prompt_logprobs(logits: torch.Tensor, next_token_ids: list[int], top: list[int]) -> list[dict[int, Logprob]]:
    """Per row of logits [rows, vocab] (positions of prompts): {token id: Logprob} of the prompt
    token that follows (next_token_ids[row]) and of the row's top[row] most likely tokens, with
    their ranks (decoded_token is the caller's to fill).

    Raw log_softmax in float32, as the sampled tokens' logprobs (vLLM's raw_logprobs). Reads the
    results back: only requests that asked for prompt logprobs pay that host sync.
    """
    if logits.shape[0] != len(next_token_ids) or len(top) != len(next_token_ids):
        raise ValueError(f"logits have {logits.shape[0]} rows; next_token_ids has {len(next_token_ids)}, "
                         f"top has {len(top)}")
    logprobs = logits.float().log_softmax(dim=-1)
    targets = torch.tensor(next_token_ids, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, targets.unsqueeze(1))
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()  # as SamplerOutput.ranks
    chosen = chosen.squeeze(1).tolist()
    k = min(max(top, default=0), logprobs.shape[1])
    values, ids = (logprobs.topk(k, dim=-1) if k else (None, None))
    values = values.tolist() if k else None
    ids = ids.tolist() if k else None
    entries = []
    for row, (token, logprob) in enumerate(zip(next_token_ids, chosen)):
        entry = {token: Logprob(logprob, ranks[row])}
        for index in range(top[row]):
            entry.setdefault(ids[row][index], Logprob(values[row][index], index + 1))
        entries.append(entry)
    return entries
