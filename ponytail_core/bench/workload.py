"""The requests a benchmark runs: token-id prompts and how many tokens each one generates."""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..errors import ConfigError

WORKLOADS = ("uniform", "mixed", "prefix")
FIRST_TOKEN_ID = 10  # below this, ids are often special tokens (BOS, EOS, padding)
PREFIX_SHARE = 0.75  # "prefix": the share of each prompt every request has in common


@dataclass(frozen=True, slots=True)
class Workload:
    kind: str  # one of WORKLOADS
    prompts: list[list[int]]  # token ids, one list per request
    output_lens: list[int]  # tokens each request generates (EOS ignored), same order

    @property
    def max_seq_len(self) -> int:
        """The longest sequence any request reaches: prompt + output."""
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(kind: str, requests: int, prompt_len: int, output_len: int, vocab_size: int,
                  seed: int = 0) -> Workload:
    """uniform: every request prompt_len + output_len tokens (random ids).
    mixed: lengths drawn from [1/4, 1] of prompt_len and of output_len, so requests finish at
    different times and the pool both grows and drains under load.
    prefix: uniform lengths, every prompt sharing its first 3/4 (a system prompt): prefix reuse.
    """
    if kind not in WORKLOADS:
        raise ConfigError(f"--workload {kind!r} is not supported; allowed: {', '.join(WORKLOADS)}")
    for flag, value in (("--requests", requests), ("--prompt-len", prompt_len), ("--output-len", output_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{flag} {value!r} is invalid; allowed: an integer >= 1")
    if vocab_size <= FIRST_TOKEN_ID:
        raise ConfigError(f"the model's vocab_size={vocab_size} is too small for random prompts "
                          f"(ids from {FIRST_TOKEN_ID} up)")
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]

    if kind == "mixed":
        prompt_lens = [rng.randint(max(1, prompt_len // 4), prompt_len) for _ in range(requests)]
        output_lens = [rng.randint(max(1, output_len // 4), output_len) for _ in range(requests)]
        prompts = [tokens(n) for n in prompt_lens]
    elif kind == "prefix":
        shared = tokens(int(prompt_len * PREFIX_SHARE))
        prompts = [shared + tokens(prompt_len - len(shared)) for _ in range(requests)]
        output_lens = [output_len] * requests
    else:
        prompts = [tokens(prompt_len) for _ in range(requests)]
        output_lens = [output_len] * requests
    return Workload(kind, prompts, output_lens)
