"""How many tokens one engine step may hold: the defaults per device and the checks of what a user sets.

Two budgets. `max_num_batched_tokens` caps a step in which some sequence decodes: its prompt chunks
delay every stream's next token, so it stays where a decode row barely notices them. A step in
which no sequence decodes (a burst of prompts on an idle engine, prompt scoring, the prefill of an
evaluation harness's loglikelihood requests) delays nobody's next token, and a larger one packs more
prompt tokens into each read of the weights: `prefill_only_batched_tokens` caps it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

# A CPU step's time grows with its tokens (and, context_aware_chunks, their context): a long prompt in
# chunks of this budget keeps the streams beside it within 2x of their usual pause (docs/engine.md),
# where 2048 stalled them for seconds.
CPU_BATCHED_TOKENS = 128
# On a GPU a prefill step's time barely grows below a few thousand tokens (the weights are read once
# per step either way), so a larger budget is more prompt tokens per weight read: vLLM's online
# default for this class of device. docs/benchmarks.md measures it against 2,048.
GPU_BATCHED_TOKENS = 8192
# Steps without decode rows on a GPU: vLLM's LLM-class budget on 70+ GB cards. docs/benchmarks.md
# (thirty-third session) measures prompt-only work at both budgets.
GPU_PREFILL_ONLY_BATCHED_TOKENS = 16384


@dataclass(frozen=True)
class TokenBudgets:
    step: int  # max_num_batched_tokens: a step with decode rows
    prefill_only_step: int  # a step of prompt chunks only

    @property
    def largest(self) -> int:
        """The most tokens any step holds: what one step's activations are sized for."""
        return max(self.step, self.prefill_only_step)


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} is not supported; allowed: an integer >= 1, "
                          "or None (the device's default)")


def token_budgets(device_type: str, max_num_seqs: int, max_num_batched_tokens: int | None = None,
                  prefill_only_batched_tokens: int | None = None) -> TokenBudgets:
    """The engine's budgets on a device of `device_type` ("cuda", "cpu", ...). None takes the default:
    max_num_batched_tokens 8,192 on CUDA (128 on the CPU), at least max_num_seqs; prefill_only_batched_tokens
    16,384 on CUDA where max_num_batched_tokens was left to its default, else max_num_batched_tokens (a
    budget set by hand is a ceiling the user chose; the CPU's keeps streams beside a prompt moving)."""
    defaulted = max_num_batched_tokens is None
    if defaulted:
        max_num_batched_tokens = max(CPU_BATCHED_TOKENS if device_type == "cpu" else GPU_BATCHED_TOKENS, max_num_seqs)
    _check_count("max_num_batched_tokens", max_num_batched_tokens)
    if max_num_batched_tokens < max_num_seqs:
        raise ConfigError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_num_seqs="
                          f"{max_num_seqs} so every running sequence can decode each step")
    if prefill_only_batched_tokens is None:
        larger = device_type == "cuda" and defaulted
        prefill_only_batched_tokens = max(GPU_PREFILL_ONLY_BATCHED_TOKENS if larger else 0, max_num_batched_tokens)
    _check_count("prefill_only_batched_tokens", prefill_only_batched_tokens)
    if prefill_only_batched_tokens < max_num_batched_tokens:
        raise ConfigError(f"prefill_only_batched_tokens={prefill_only_batched_tokens} must be >= "
                          f"max_num_batched_tokens={max_num_batched_tokens}: a step without decode rows may "
                          "hold more prompt tokens than one with them, never fewer")
    return TokenBudgets(max_num_batched_tokens, prefill_only_batched_tokens)
