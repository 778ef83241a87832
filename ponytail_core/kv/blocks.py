"""What the block allocator hands out and hashes: a block, the results of allocate/append, prefix hashes."""

from __future__ import annotations

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



def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block, chained over the previous block's hash (prefix identity)."""
    return hash((prev_hash, token_ids))
