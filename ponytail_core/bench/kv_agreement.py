"""With --kv-cache-dtype fp8: how often the FP8 engine picks the same greedy token as the engine
storing K/V in the model's dtype, on the output check's prompts.

FP8 rounds every stored K and V to 3 mantissa bits, so where the top two tokens are close the FP8
side may take the other one, and from there the two continuations part ways. That is the price of
the format, not a bug, so this is reported, never judged: the auto side's output check is what
says the engine is right. The share counts the steps where both chose the same token at the same
position; after a request's first difference its later steps mostly differ too, so the first
difference per request is given beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..sampling.params import SamplingParams


@dataclass(frozen=True, slots=True)
class KVAgreement:
    side: str  # the FP8 side, e.g. "ponytail fp8"
    kv_cache_dtype: str  # its kv_cache_dtype
    requests: int  # the output check's prompts
    steps: int  # greedy tokens per request
    same_tokens: int  # steps where the FP8 side chose the auto side's token
    first_difference: list[int | None] = field(default_factory=list)  # per request: step, or None
    tokens: list[list[int]] = field(default_factory=list)  # the FP8 side's greedy tokens

    @property
    def share(self) -> float:
        total = self.requests * self.steps
        return self.same_tokens / total if total else 1.0

    def to_dict(self) -> dict:
        return {"side": self.side, "kv_cache_dtype": self.kv_cache_dtype, "judged": False, "requests": self.requests,
                "steps": self.steps, "of": self.requests * self.steps, "same_tokens": self.same_tokens,
                "share": self.share, "first_difference": self.first_difference}

    def summary(self) -> str:
        total = self.requests * self.steps
        return (f"{self.side}: {self.same_tokens}/{total} greedy tokens ({self.share:.0%}) the same as the auto "
                f"side's on the check prompts; first difference per request: {self.first_difference}. FP8 KV "
                f"is lossy (3 mantissa bits), so differences are reported, not failed")


def kv_agreement(side: str, kv_cache_dtype: str, prompts: list[list[int]], reference: list[list[int]],
                 generate: Callable[[list[list[int]], SamplingParams], list[Any]]) -> KVAgreement:
    """The FP8 engine's greedy tokens on `prompts` against `reference` (the auto side's, same
    length each); generate(prompts, params) runs the FP8 engine and keeps no engine."""
    steps = len(reference[0]) if reference else 0
    outputs = generate(prompts, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    tokens = [list(o.token_ids) for o in outputs]
    same = sum(a == b for x, y in zip(tokens, reference) for a, b in zip(x, y))
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(tokens, reference)]
    return KVAgreement(side, kv_cache_dtype, len(prompts), steps, same, first, tokens)
