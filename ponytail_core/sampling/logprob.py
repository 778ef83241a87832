"""One entry of a token's logprobs, as vLLM's outputs give it: `.logprob`, `.rank`, `.decoded_token`,
and the token texts those entries carry.

A Logprob is also the float it holds, so code that took Ponytail's earlier `{token id: float}`
entries (arithmetic, JSON, pydantic float fields) keeps working unchanged.
"""

from __future__ import annotations


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
