"""The paged KV cache: block bookkeeping + device storage + the elastic-pool policy.

Sequences take blocks as they grow and give them back when they finish; the pool grows a chunk
at a time within the memory budget and, when load falls, compacts live blocks into the lowest
ids and hands the freed tail back to the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import cache_ops
from .block_allocator import BlockAllocator
from .blocks import Allocation, NoRoom
from .config import CacheConfig
from .storage import PagedKVStorage


@dataclass(frozen=True, slots=True)
class DefragResult:
    blocks_moved: int  # blocks copied to lower ids (each covers every layer, K and V)
    bytes_moved: int  # bytes copied on the device


@dataclass(frozen=True, slots=True)
class MaintenanceReport:
    chunks_added: int
    defrag: DefragResult | None  # None when fragmentation stayed under the threshold
    chunks_released: int


@dataclass(frozen=True, slots=True)
class CacheStats:
    total_blocks: int  # blocks the pool holds now
    max_blocks: int  # blocks the memory budget allows
    free_blocks: int  # allocatable now, evictable prefix blocks included
    used_blocks: int  # held by live sequences
    evictable_blocks: int  # cached prefix blocks nobody holds
    num_seqs: int
    high_water_mark: int
    fragmentation: float
    allocated_bytes: int  # device memory the pool holds


class PagedKVCache:
    """A paged KV cache for one model on one device. See `ponytail.create_cache`."""

    # Policy knobs (tuning values, not configuration most users touch).
    GROW_WHEN_FREE_BELOW = 0.05  # maintain() adds a chunk when free blocks fall under this share
    KEEP_FREE_CHUNKS = 1  # maintain() keeps this many chunks of free headroom when shrinking

    def __init__(self, config: CacheConfig, initial_chunks: int = 1, release_after_s: float = 0.0):
        self.config = config
        # maintain() gives chunks back only once the pool has had them spare this long: a server
        # whose bursts come seconds apart keeps its working size instead of regrowing every burst.
        self.release_after_s = release_after_s
        self._spare_since: float | None = None  # when maintain() first saw chunks to spare, in a row
        chunk_blocks = config.pool_chunk_blocks
        self.max_chunks = config.max_num_blocks // chunk_blocks
        self.storage = PagedKVStorage(config, chunk_blocks, self.max_chunks)
        self.allocator = BlockAllocator(0, config.block_size)
        self.num_defragmentations = 0  # compactions that moved at least one block
        self.num_blocks_moved = 0  # blocks those compactions copied
        self.num_chunks_released = 0
        self.peak_allocated_bytes = 0  # the most device memory the pool has held
        self.grow(initial_chunks)

    # ------------------------------------------------------------ sequences
    def allocate(self, seq_id, token_ids: list[int], max_cached_tokens: int | None = None) -> Allocation | NoRoom:
        """Blocks for a new sequence's tokens; `num_cached_tokens` of them are already stored."""
        result = self.allocator.allocate(seq_id, token_ids, max_cached_tokens)
        if isinstance(result, NoRoom) and self._grow_for(result):
            result = self.allocator.allocate(seq_id, token_ids, max_cached_tokens)
        return result

    def append(self, seq_id, token_ids: list[int]) -> Allocation | NoRoom:
        """Slots for tokens after the sequence's end; copy-on-write runs before this returns."""
        result = self.allocator.append(seq_id, token_ids)
        if isinstance(result, NoRoom) and self._grow_for(result):
            result = self.allocator.append(seq_id, token_ids)
        if result:
            cache_ops.copy_blocks(self.storage, result.copies)
        return result

    def mark_computed(self, seq_id, num_tokens: int) -> None:
        """K/V of the sequence's first `num_tokens` tokens are written: their full blocks may now
        serve other prompts with the same prefix."""
        self.allocator.commit(seq_id, num_tokens)

    def replace_token(self, seq_id, position: int, token: int) -> None:
        """A placeholder in the sequence's last block becomes the real token (async scheduling:
        call it before mark_computed covers that block). Bookkeeping only: the K/V written at the
        position came from the real token, which the device already had."""
        self.allocator.replace_token(seq_id, position, token)

    def fork(self, parent_id, child_id) -> None:
        self.allocator.fork(parent_id, child_id)

    def free(self, seq_id) -> None:
        self.allocator.free(seq_id)

    def write(self, keys: torch.Tensor, values: torch.Tensor, slots, layer_start: int = 0) -> None:
        """Store keys/values [layers, tokens, kv_heads, head_dim] at their slots (-1 = skip)."""
        cache_ops.write_slots(self.storage, keys, values, self._slot_tensor(slots), layer_start)

    def read(self, seq_id) -> torch.Tensor:
        """A copy of a sequence's K/V, [num_layers, 2, tokens, kv_heads, head_dim] (tests, debugging)."""
        return self.storage.read_tokens(self.allocator.block_table(seq_id), self.allocator.seq_len(seq_id))

    def block_table(self, seq_id) -> list[int]:
        return self.allocator.block_table(seq_id)

    def seq_len(self, seq_id) -> int:
        return self.allocator.seq_len(seq_id)

    # ------------------------------------------------------------------ pool
    @property
    def num_chunks(self) -> int:
        return len(self.storage.chunks)

    @property
    def available_blocks(self) -> int:
        """Blocks a request could get now: free, evictable, and what the budget still lets us grow."""
        return self.allocator.num_free + (self.max_chunks - self.num_chunks) * self.storage.chunk_blocks

    @property
    def fragmentation(self) -> float:
        return self.allocator.fragmentation

    def grow(self, num_chunks: int = 1) -> int:
        """Add up to `num_chunks` chunks within the memory budget; returns how many were added."""
        count = max(0, min(num_chunks, self.max_chunks - self.num_chunks))
        if count:
            self.storage.add_chunks(count)
            self.allocator.grow(count * self.storage.chunk_blocks)
            self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.storage.allocated_bytes)
        return count

    def defragment(self) -> DefragResult:
        """Move every block holding data into the lowest ids (fewest moves, one launch)."""
        moves = self.allocator.plan_compaction()
        cache_ops.copy_blocks(self.storage, list(moves.items()))
        self.num_defragmentations += bool(moves)
        self.num_blocks_moved += len(moves)
        return DefragResult(blocks_moved=len(moves), bytes_moved=len(moves) * self.config.block_bytes)

    def shrink(self, keep_free_blocks: int = 0, min_chunks: int = 1) -> int:
        """Give tail chunks back to the device; returns how many chunks were released.

        Keeps every block live sequences hold, at least `keep_free_blocks` more and `min_chunks`
        chunks. Cached prefix blocks that no longer fit are evicted, least recently used first;
        the rest are compacted below the cut together with the live ones.
        """
        chunk_blocks = self.storage.chunk_blocks
        release = self.spare_chunks(keep_free_blocks, min_chunks)
        if release <= 0:
            return 0
        capacity = (self.num_chunks - release) * chunk_blocks
        holding_data = self.allocator.num_used + self.allocator.num_evictable
        self.allocator.evict(holding_data - capacity)
        if self.allocator.high_water_mark > capacity:
            self.defragment()
        self.allocator.shrink(release * chunk_blocks)
        self.storage.release_chunks(release)
        self.num_chunks_released += release
        return release

    def spare_chunks(self, keep_free_blocks: int = 0, min_chunks: int = 1) -> int:
        """Tail chunks shrink() would release now."""
        needed = max(min_chunks, -(-(self.allocator.num_used + keep_free_blocks) // self.storage.chunk_blocks))
        return max(0, self.num_chunks - needed)

    @property
    def _headroom_blocks(self) -> int:
        """Free blocks maintain() keeps when it releases chunks."""
        return self.KEEP_FREE_CHUNKS * self.storage.chunk_blocks

    def seconds_until_release(self, now: float | None = None) -> float | None:
        """How long until maintain() would give spare chunks back (the count starts now if it had
        not started); None when no chunk is spare."""
        if not self.spare_chunks(self._headroom_blocks):
            return None
        now = time.monotonic() if now is None else now
        if self._spare_since is None:
            self._spare_since = now
        return max(0.0, self._spare_since + self.release_after_s - now)

    def maintain(self, reserve_blocks: int | None = None, now: float | None = None) -> MaintenanceReport:
        """The automatic policy, run between steps: grow when free blocks run low, compact past
        the fragmentation threshold (like llama.cpp's defrag_thold), release idle tail chunks.

        reserve_blocks: free blocks wanted before the next maintenance (the engine passes what its
        running requests can take by then); None: GROW_WHEN_FREE_BELOW of the pool. Growing
        ahead of need only saves an allocation inside a step (allocate/append grow on demand),
        so a tight reserve keeps the pool's peak close to what live tokens need. Spare chunks go
        back only after `release_after_s` of being spare at every call (now: time.monotonic())."""
        added = 0
        low = self.GROW_WHEN_FREE_BELOW * self.allocator.num_blocks if reserve_blocks is None else reserve_blocks
        if self.allocator.num_free < low:
            added = self.grow(1)
        defrag = None
        if self.fragmentation >= self.config.defrag_threshold and self.fragmentation > 0:
            defrag = self.defragment()
        released = 0
        wait = None if added else self.seconds_until_release(now)
        if wait == 0:
            released = self.shrink(keep_free_blocks=self._headroom_blocks)
        if wait is None or released:
            self._spare_since = None  # nothing spare (or no longer): the next spare spell counts from 0
        return MaintenanceReport(chunks_added=added, defrag=defrag, chunks_released=released)

    def stats(self) -> CacheStats:
        a = self.allocator
        return CacheStats(
            total_blocks=a.num_blocks, max_blocks=self.max_chunks * self.storage.chunk_blocks,
            free_blocks=a.num_free, used_blocks=a.num_used, evictable_blocks=a.num_evictable,
            num_seqs=len(a.seq_ids()), high_water_mark=a.high_water_mark,
            fragmentation=a.fragmentation, allocated_bytes=self.storage.allocated_bytes)

    def invariants(self) -> list[str]:
        problems = self.allocator.invariants()
        if self.allocator.num_blocks != self.storage.num_blocks:
            problems.append(f"allocator has {self.allocator.num_blocks} blocks, storage {self.storage.num_blocks}")
        return problems

    # --------------------------------------------------------------- helpers
    def _grow_for(self, no_room: NoRoom) -> bool:
        """Grow enough for a refused request if the budget allows it; True if it grew."""
        missing = no_room.needed - no_room.free
        chunks = -(-missing // self.storage.chunk_blocks)
        if self.num_chunks + chunks > self.max_chunks:
            return False
        return self.grow(chunks) == chunks

    def _slot_tensor(self, slots) -> torch.Tensor:
        if isinstance(slots, torch.Tensor):
            return slots.to(device=self.storage.device, dtype=torch.int64)
        tensor = torch.tensor(slots, dtype=torch.int64)
        if self.storage.device.type == "cuda":
            tensor = tensor.pin_memory().to(self.storage.device, non_blocking=True)
        return tensor

    def __repr__(self) -> str:
        c, s = self.config, self.stats()
        return (f"PagedKVCache(layers={c.num_layers}, kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, "
                f"dtype={c.dtype}, block_size={c.block_size}, blocks={s.used_blocks} used / "
                f"{s.total_blocks} held / {s.max_blocks} max, device={c.device})")
