"""What the block allocator hands out and hashes: a block, the results of allocate/append, prefix hashes."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # chained prefix hash, set once the block is full
    token_ids: tuple[int, ...] = ()  # the tokens of a full block, checked on every hash hit

    def reset(self) -> None:
        self.ref_count = 0
        self.hash = None
        self.token_ids = ()


@dataclass(frozen=True, slots=True)
class NoRoom:
    """Result of a request the pool cannot meet now. Falsy; nothing was changed."""

    needed: int  # blocks the request needs
    free: int  # blocks that could be handed out (free + evictable)

    def __bool__(self) -> bool:
        return False

    @property
    def message(self) -> str:
        return f"no room: needs {self.needed} free KV blocks, {self.free} available"


@dataclass(frozen=True, slots=True)
class Allocation:
    """What a caller must do after allocate/append succeeded."""

    slots: list[int]  # slot id (block_id * block_size + offset) for each token to write
    copies: list[tuple[int, int]]  # (src, dst) blocks to copy before writing (copy-on-write)
    num_cached_tokens: int = 0  # leading tokens whose K/V is already present (prefix hit)


ROOT_HASH = 0  # what the first block chains over


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block, chained over the previous block's hash (prefix identity).

    The same in every process, so a router elsewhere can compute what an engine caches: ints and
    tuples of ints hash by value, while None (before Python 3.12) hashes by its address.
    """
    return hash((ROOT_HASH if prev_hash is None else prev_hash, token_ids))


def salt_root(cache_salt: str | None) -> int | None:
    """Where a salted prompt's chain starts (None: the shared ROOT_HASH). A digest, not hash(): a
    str's hash changes from process to process, and a router must compute what an engine caches."""
    if cache_salt is None:
        return None
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8).digest(), "little", signed=True)


def prefix_block_hashes(token_ids: list[int] | tuple[int, ...], block_size: int,
                        max_cached_tokens: int | None = None, cache_salt: str | None = None) -> list[int]:
    """The chain hashes BlockAllocator.allocate looks up for a prompt's full blocks, up to
    `max_cached_tokens` tokens, in order.

    An engine admits a prompt with max_cached_tokens = len(prompt) - 1 (its last token is always
    computed); the same cap here makes a match on these hashes exactly the engine's prefix hit.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} is not supported; allowed: an int >= 1")
    limit = len(token_ids) if max_cached_tokens is None else min(len(token_ids), max_cached_tokens)
    hashes: list[int] = []
    prev_hash = salt_root(cache_salt)
    for start in range(0, limit - block_size + 1, block_size):
        prev_hash = chain_hash(prev_hash, tuple(token_ids[start : start + block_size]))
        hashes.append(prev_hash)
    return hashes
