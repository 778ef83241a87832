"""The requests bench_engine.py runs on every engine, and the length distribution bench_serve.py sends.

Workloads (full size; `small=True` shrinks each for a CPU run of the default model):
- fixed: --requests x --prompt-len / --output-len (default 64 x 512 / 1,024).
- long: 16 x 4,096 / 512.
- mixed: chat-like traffic, 256 requests, lengths from `mixed_lengths`: prompts are a mixture, 90%
  log-normal around 250 tokens (sigma 0.9: most between 50 and 1,000) and 10% uniform over
  1,500-6,000 tokens (pasted documents: the long tail); outputs log-normal around 150 tokens
  (sigma 1.0), clipped to 16-1,536. Seeded: the same seed gives the same requests everywhere.
- prefix: 256 requests sharing a 2,048-token system prompt, each then 32-256 tokens of its own,
  256 output tokens.
- prefill: the mixed prompts (other token ids) with 1 output token: prompt tokens/s.
- decode: the mixed output lengths after short prompts (16-64 tokens): many short sequences.
Every request is clipped to the model's length (prompt + output <= max_len); fixed and long are
refused instead when they do not fit, since their shape is the point. Token ids are drawn per
workload from its own seed, so no workload finds another's prompts in a prefix cache.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass

WORKLOADS = ("fixed", "long", "mixed", "prefix", "prefill", "decode")
FIRST_TOKEN_ID = 10  # below this, ids are often special tokens (BOS, EOS, padding)
SMALL_SCALE = 32  # --small: lengths divided by this
MIXED_REQUESTS, PREFIX_REQUESTS, SYSTEM_PROMPT = 256, 256, 2048
LONG_SHARE, LONG_PROMPT = 0.10, (1500, 6000)  # mixed: the pasted-document tail
PROMPT_MEDIAN, PROMPT_SIGMA = 250, 0.9
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_RANGE = 150, 1.0, (16, 1536)


@dataclass(frozen=True, slots=True)
class PeerWorkload:
    name: str  # one of WORKLOADS
    prompts: list[list[int]]  # token ids, one list per request
    output_lens: list[int]  # tokens each request generates (EOS ignored), same order
    metric: str  # what the table ranks it by: "output" or "prompt" tokens/s

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_seq_len(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens))

    def to_json(self) -> dict:
        return {"name": self.name, "prompts": self.prompts, "output_lens": self.output_lens, "metric": self.metric}


def mixed_lengths(n: int, seed: int = 0, max_len: int | None = None, scale: int = 1) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of `n` chat-like requests (see the module docstring); lengths
    divided by `scale` (at least 4 and 2), each pair clipped so prompt + output <= max_len."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        if rng.random() < LONG_SHARE:
            prompt = rng.randint(*LONG_PROMPT)
        else:
            prompt = round(rng.lognormvariate(math.log(PROMPT_MEDIAN), PROMPT_SIGMA))
        output = round(rng.lognormvariate(math.log(OUTPUT_MEDIAN), OUTPUT_SIGMA))
        prompt, output = max(16, min(prompt, LONG_PROMPT[1])), min(max(output, OUTPUT_RANGE[0]), OUTPUT_RANGE[1])
        prompt, output = max(4, prompt // scale), max(2, output // scale)
        if max_len is not None:
            output = min(output, max_len // 4)
            prompt = min(prompt, max_len - output)
        pairs.append((prompt, output))
    return pairs


def build(name: str, vocab_size: int, max_len: int, *, seed: int = 0, small: bool = False,
          fixed: tuple[int, int, int] = (64, 512, 1024)) -> PeerWorkload:
    """One workload's requests for a model with `vocab_size` ids and `max_len` positions.
    fixed: (requests, prompt_len, output_len) of the "fixed" workload."""
    if name not in WORKLOADS:
        raise ValueError(f"--workload {name!r} is not known; allowed: {', '.join(WORKLOADS)}, all")
    scale = SMALL_SCALE if small else 1
    rng = random.Random(seed * 1_000_003 + zlib.crc32(name.encode()))

    def ids(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]

    def shaped(requests: int, prompt_len: int, output_len: int) -> PeerWorkload:
        if prompt_len + output_len > max_len:
            raise ValueError(f"--workload {name}: {prompt_len} + {output_len} tokens per request do not fit the "
                             f"model's {max_len} positions")
        return PeerWorkload(name, [ids(prompt_len) for _ in range(requests)], [output_len] * requests, "output")

    if name == "fixed":
        requests, prompt_len, output_len = fixed
        return shaped(requests, prompt_len, output_len)
    if name == "long":
        return shaped(2 if small else 16, 4096 // scale, 512 // scale)
    requests = 6 if small else MIXED_REQUESTS
    pairs = mixed_lengths(requests, seed, max_len, scale)  # the same lengths for mixed, prefill, decode
    if name == "mixed":
        return PeerWorkload(name, [ids(p) for p, _ in pairs], [o for _, o in pairs], "output")
    if name == "prefill":
        return PeerWorkload(name, [ids(p) for p, _ in pairs], [1] * len(pairs), "prompt")
    if name == "decode":
        return PeerWorkload(name, [ids(rng.randint(16, 64) // (4 if small else 1)) for _ in pairs],
                            [o for _, o in pairs], "output")
    system = ids(SYSTEM_PROMPT // scale)  # prefix
    requests = 6 if small else PREFIX_REQUESTS
    own = [rng.randint(32, 256) // scale + 1 for _ in range(requests)]
    return PeerWorkload(name, [system + ids(n) for n in own], [max(2, 256 // scale)] * requests, "output")


def build_all(names: list[str], vocab_size: int, max_len: int, **kwargs) -> list[PeerWorkload]:
    return [build(name, vocab_size, max_len, **kwargs) for name in names]


def check_prompts(vocab_size: int, requests: int = 4, length: int = 32, seed: int = 0) -> list[list[int]]:
    """The greedy check's sample: short prompts no workload shares."""
    rng = random.Random(seed * 7919 + 17)
    return [[rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(length)] for _ in range(requests)]
