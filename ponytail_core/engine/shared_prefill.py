"""Prompts that would compute the same prefix in one step: admit the first, hold the rest a step.

A prompt's full blocks reach the prefix cache only once their K/V is written (commit after the step
is launched), so prompts admitted into the same step with a common uncached prefix (a burst of
requests on one system prompt or one document, or a prompt whose shared part another prompt is still
prefilling in chunks) would each compute it, and each hold its own copy of that KV until it ends.
Held back one step instead (keeping its place in the queue, while prompts behind it that share
nothing are admitted), a prompt finds the prefix cached and computes only its own tokens: the step
budget and the blocks go to work nobody else does (SGLang's scheduler holds such prompts back too).
A prompt is held only when the prefix it shares is at least half of what it has left to compute, so
a short common opening (a chat template's first block) never holds a prompt back.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..kv.paged_cache import PagedKVCache


class PendingPrefixes:
    """The full blocks this step computes for prompts: hash -> (that prompt's hashes, index)."""

    def __init__(self, cache: PagedKVCache, prefilling: Iterable[tuple[object, int]]):
        """prefilling: (seq id, tokens it holds) of each prompt the step computes a chunk of."""
        self.cache = cache
        self.block_size = cache.config.block_size
        self._blocks: dict[int, tuple[list, int]] = {}
        for seq_id, num_tokens in prefilling:
            # Its blocks already committed never match a new prompt's first uncached block (that
            # prompt would have hit them), so the whole prompt may be listed.
            self._add(cache.block_hashes(seq_id, 0, num_tokens // self.block_size))

    def _add(self, hashes: list) -> None:
        for index, block_hash in enumerate(hashes):
            if block_hash is not None:
                self._blocks.setdefault(block_hash, (hashes, index))

    def holds_back(self, seq_id, num_tokens: int, num_cached: int) -> bool:
        """Whether a prompt just allocated (num_tokens, num_cached of them found cached) shares at
        least half of what it has left with blocks this step computes for another prompt; if not,
        its own blocks are listed for the prompts after it."""
        bs = self.block_size
        mine = self.cache.block_hashes(seq_id, num_cached // bs, num_tokens // bs)
        found = self._blocks.get(mine[0]) if mine and mine[0] is not None else None
        shared = 0
        if found is not None:
            theirs, index = found
            while shared < len(mine) and index + shared < len(theirs) and theirs[index + shared] == mine[shared]:
                shared += 1
        if shared and 2 * shared * bs >= num_tokens - num_cached:
            return True
        self._add(mine)
        return False
